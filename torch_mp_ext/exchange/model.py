"""Model exchange between a learner and its collectors, DI-engine style.

Adapted from DI-engine's ``ding/framework/middleware/distributer.py`` (``ModelExchanger``,
``PeriodicalModelExchanger``), keeping their arguments and their semantics; changes:

- models travel through a :class:`~torch_mp_ext.StateDictChannel` in shared memory (or a
  ``torch.distributed`` broadcast across hosts, ``backend="gloo"``/``"nccl"``), not as a
  pickle on a message bus: the learner copies its state_dict once, each collector copies
  the newest complete version straight into its model, or (``copy=False``) makes its model
  view that version in place, with no copy at all;
- a process's role is an argument (``role=``, or ``mode=`` as in DI-engine), not a task's;
- freshness is judged by version numbers and this host's monotonic clock, never by
  comparing wall clocks of two hosts (across hosts ``delay_toleration`` counts from the
  moment a version arrived);
- every wait has a timeout (DI-engine's 60 s by default) that logs DI-engine's warning, naming
  the process; a closed channel ends waits at once (DI-engine's ``task.finish``);
- DI-engine's busy spin on a cached model older than ``delay_toleration`` is a plain wait for
  a fresher one.

Both classes work as plain calls in a training loop (``send()``, ``receive(timeout=...)``)
and as DI-engine's middleware: calling one with a context returns the step generator that
DI-engine's task (or :func:`run_step`) drives::

    learner                                      collector
    ex = ModelExchanger(model, role="learner",   ex = ModelExchanger(model, role="collector",
                        channel=ch)                                  channel=ch)
    for ctx in steps:                            for ctx in steps:
        train(model, ctx)                            if ctx.total_step:     # skip the first
        ex.send()                                        ex.receive()       # newest version
                                                     collect(model, ctx)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import os
import time
from collections.abc import Generator, Iterable
from typing import Any, Callable

import torch

from ..errors import ChannelClosedError
from ..timeouts import seconds
from .channel import StateDictChannel

__all__ = ["Context", "ModelExchanger", "PeriodicalModelExchanger", "run_step"]

logger = logging.getLogger("torch_mp_ext.exchange")

ROLES = ("learner", "collector", "evaluator")
#: DI-engine's patience: a receiver waits this long for a model, then warns and goes on.
DEFAULT_TIMEOUT = 60.0
_DEFAULT: Any = object()  # "the exchanger's own timeout"


@dataclasses.dataclass
class Context:
    """The fields of DI-engine's ``OnlineRLContext`` that the exchangers read and write.

    Any object with these attributes (DI-engine's own contexts included) works as well.

    Example:
        ```python
        from torch_mp_ext.exchange import Context

        ctx = Context()
        ctx.train_iter += 1
        assert ctx.total_step == 0 and ctx.trajectories is None
        ```
    """

    total_step: int = 0
    env_step: int = 0
    env_episode: int = 0
    train_iter: int = 0
    trajectories: list | None = None
    episodes: list | None = None
    trajectory_end_idx: list | None = None


def run_step(ctx: Any, *middleware: Callable[[Any], Any]) -> None:
    """Runs one step of a DI-engine-style pipeline on ``ctx``.

    Each middleware is called in order; one that returns a generator runs to its ``yield``
    and is resumed after the rest of the pipeline, innermost first (``task.forward`` then
    ``task.backward`` in DI-engine).

    Args:
        ctx: the context every middleware reads and writes (a :class:`Context`).
        *middleware: callables ``f(ctx)``, in pipeline order (the exchangers are some).

    Example:
        ```python
        from torch_mp_ext.exchange import Context, run_step

        calls = []

        def outer(ctx):
            calls.append("forward")
            yield
            calls.append("backward")

        def inner(ctx):
            calls.append("step")

        run_step(Context(), outer, inner)
        assert calls == ["forward", "step", "backward"]
        ```
    """
    pending = []
    for fn in middleware:
        out = fn(ctx)
        if isinstance(out, Generator):
            try:
                next(out)
            except StopIteration:
                continue
            pending.append(out)
    for gen in reversed(pending):
        for _ in gen:
            raise RuntimeError(f"middleware {getattr(gen, '__qualname__', gen)} yielded more "
                               "than once per step")


def process_label(role: str) -> str:
    """``"Name (pid N, role R)"``: how warnings name the process."""
    return f"{multiprocessing.current_process().name} (pid {os.getpid()}, role {role})"


def check_role(role: str, allowed: Iterable[str], what: str) -> str:
    if role not in allowed:
        raise ValueError(f"{what} must be one of {sorted(allowed)}, got {role!r}")
    return role


def check_loader(loader: Any, name: str) -> None:
    if loader is not None:
        raise ValueError(
            f"{name} is not supported: DI-engine's loaders exist to keep pickling and files off "
            "the critical path, and torch_mp_ext's channels never pickle a tensor; pass None")


def model_transport(model: torch.nn.Module, channel: StateDictChannel | None, backend: str,
                    is_learner: bool, learner_rank: int) -> Any:
    """The channel the exchangers publish to and read from, picked by ``backend``."""
    if backend == "shm":
        if channel is None:
            raise ValueError(
                "backend='shm' needs channel=: make one StateDictChannel(model) in the parent "
                "and pass it to the learner and every collector")
        if is_learner:
            channel._claim_publisher()  # collectors can tell its death from its finish
        return channel
    if channel is not None:
        raise ValueError(f"channel= is for backend='shm'; backend={backend!r} broadcasts over "
                         "torch.distributed instead")
    if backend == "distributed":  # NCCL for a model on a GPU, gloo for one on the CPU
        cuda = any(t.is_cuda for t in model.state_dict().values())
        backend = "nccl" if cuda else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(
            f"backend must be 'shm', 'distributed', 'gloo' or 'nccl', got {backend!r}")
    from .dist import DistModelChannel

    return DistModelChannel(model, backend=backend, is_learner=is_learner,
                            learner_rank=learner_rank)


def check_copy(copy: bool, receives: bool, backend: str) -> bool:
    if not isinstance(copy, bool):
        raise TypeError(f"copy must be True or False, got {copy!r}")
    if not copy and not receives:
        raise ValueError("copy=False is for receivers (collectors, evaluators): the learner "
                         "publishes, and a publish always copies the state once")
    if not copy and backend != "shm":
        raise ValueError(
            f"copy=False reads versions in place in a StateDictChannel (backend='shm'); "
            f"backend={backend!r} copies each version into the model")
    return copy


class _Receiver:
    """The receiving side shared by both exchangers."""

    _model: torch.nn.Module
    _channel: Any
    _role: str
    _copy: bool
    timeout: float | None
    _name: str

    def _load(self, newer_than: int, **kwargs: Any) -> int:
        """Loads the newest version above ``newer_than`` into the model: a copy, or a borrow
        (``copy=False``: the model views it in place, Note [Borrowed versions])."""
        if self._copy:
            return self._channel.read_into(self._model, newer_than, **kwargs)
        return self._channel.borrow_into(self._model, newer_than, **kwargs)

    def release(self) -> None:
        """Receivers with ``copy=False``: gives the model private copies of the borrowed
        weights (one copy), so the channel may reuse the version's buffer. Not needed
        between steps: the next ``receive()`` lets the old version go by itself."""
        if not self._copy:
            self._channel.release(self._model)

    def _timeout(self, timeout: Any) -> float | None:
        return seconds(self.timeout if timeout is _DEFAULT else timeout)  # Note [Timeout values]

    def _warn_timeout(self, newer_than: int, timeout: float | None) -> None:
        logger.warning(
            "Timeout when waiting for new model! Process %s got no version newer than %d "
            "from %s within %s s (latest published: %d); going on with the current weights",
            process_label(self._role), newer_than, self._name, timeout, self._channel.version)

    @property
    def finished(self) -> bool:
        """True once the learner closed the channel (it is done): nothing more will come.

        Raises:
            PeerDiedError: the learner died without closing (SIGKILL, a crash, a lost
                connection): that is not a finish (Note [Publisher death] in
                ``csrc/exchange/latest.h``, Note [Exchange over torch.distributed]).
        """
        self._channel.check_peer()
        return self._channel.closed

    def close(self) -> None:
        """Learner: closes the channel, so receivers stop waiting. Receivers: let go of a
        ``torch.distributed`` backend's receiving thread (a shared-memory channel is left
        open for the others)."""
        if self._role == "learner" or not isinstance(self._channel, StateDictChannel):
            self._channel.close()


class ModelExchanger(_Receiver):
    """The learner sends its model after every step; the others load the newest one.

    Args:
        model: this process's model (the learner's is sent, the others' overwritten).
        model_loader: DI-engine's ``ModelLoader``; must be None (nothing is pickled here).
        role: ``"learner"`` sends; ``"collector"`` and ``"evaluator"`` receive.
        channel: the :class:`StateDictChannel` shared by all (``backend="shm"``).
        backend: ``"shm"`` (one host, shared memory), or ``torch.distributed``:
            ``"distributed"`` (NCCL for a model on a GPU, gloo otherwise), ``"gloo"`` or
            ``"nccl"``; the learner's rank broadcasts each version to every rank of the
            default process group, and all ranks make their exchangers in one order.
        learner_rank: the learner's rank (distributed backends).
        timeout: seconds a receiver waits for a newer model (``None``: forever) before
            DI-engine's warning.
        copy: receivers: ``True`` copies each version into the model; ``False`` makes the
            model's parameters and buffers views of it, with no copy
            (:meth:`StateDictChannel.borrow_into`: CPU models in ``eval()`` mode that never
            write their weights; ``backend="shm"``).

    Raises:
        ValueError: an unknown role or backend, a missing channel, a model that does not
            match the channel's template (on ``send``/``receive``, naming the key),
            ``copy=False`` for the learner or another backend.

    Example:
        ```python
        import torch
        import torch_mp_ext as mp

        def collector(channel):
            model = torch.nn.Linear(4, 2)
            models = mp.ModelExchanger(model, role="collector", channel=channel)
            models.receive(timeout=60)   # the newest weights, copied into the model in place
            assert model.bias.eq(1).all()

        if __name__ == "__main__":
            model = torch.nn.Linear(4, 2)
            channel = mp.StateDictChannel(model)
            models = mp.ModelExchanger(model, role="learner", channel=channel)
            with torch.no_grad():
                model.bias.fill_(1)
            models.send()
            p = mp.Process(target=collector, args=(channel,))
            p.start()
            p.join(60)
            assert p.exitcode == 0
            models.close()
        ```
    """

    def __init__(self, model: torch.nn.Module, model_loader: Any = None, *, role: str,
                 channel: StateDictChannel | None = None, backend: str = "shm",
                 learner_rank: int = 0, timeout: float | None = DEFAULT_TIMEOUT,
                 copy: bool = True) -> None:
        check_loader(model_loader, "model_loader")
        self._model = model
        self._role = check_role(role, ROLES, "role")
        self._is_learner = role == "learner"
        self._copy = check_copy(copy, not self._is_learner, backend)
        self._channel = model_transport(model, channel, backend, self._is_learner, learner_rank)
        self._name = getattr(self._channel, "name", "model_exchanger")
        self.timeout = timeout
        self._version = -1

    @property
    def version(self) -> int:
        """The version this process last sent (learner) or loaded (others); -1: none."""
        return self._version

    def send(self) -> int:
        """Learner: publishes the model as the next version and returns it."""
        if not self._is_learner:
            raise RuntimeError(f"send() is the learner's; this exchanger's role is {self._role!r}")
        newer = max(self._version, self._channel.version) + 1
        self._version = self._channel.publish(self._model, newer)
        return self._version

    def receive(self, timeout: float | None = _DEFAULT) -> int | None:
        """Others: waits for a version newer than the loaded one and loads the newest.

        Args:
            timeout: seconds to wait (default: the exchanger's; ``None`` forever).

        Returns:
            The version loaded, or None when none came within ``timeout`` (after DI-engine's
            warning, naming this process) or the channel is closed.

        Raises:
            PeerDiedError: the learner died without closing the channel.
        """
        if self._is_learner:
            raise RuntimeError("receive() is for collectors and evaluators; the learner sends")
        self._channel.check_peer()
        timeout = self._timeout(timeout)
        try:
            self._version = self._load(self._version, timeout=timeout)
        except TimeoutError:
            self._warn_timeout(self._version, timeout)
            return None
        except ChannelClosedError:
            return None
        return self._version

    def __call__(self, ctx: Any) -> Generator[None, None, None]:
        """DI-engine's middleware: a learner sends after the step, the others load the newest
        model before every step but the first (``ctx.total_step == 0``)."""
        if not self._is_learner:
            if ctx.total_step != 0:  # Skip first iteration
                self.receive()
        else:
            yield
            self.send()


class PeriodicalModelExchanger(_Receiver):
    """Sends the model every ``period`` iterations; receivers may reuse a recent one.

    A receiver loads a version newer than its own when one is there and younger than
    ``delay_toleration`` seconds (then its staleness is 1). When nothing new is there it
    keeps its weights as long as its staleness (iterations since the last load) is below
    ``stale_toleration`` and the newest version it saw is younger than ``delay_toleration``;
    otherwise it waits (up to ``timeout``) for a fresh version.

    Args:
        model: this process's model.
        mode: ``"send"`` or ``"receive"``.
        period: the sender publishes iterations 0, period, 2 period, ...; a receiver takes
            only versions that are multiples of its ``period``.
        delay_toleration: seconds after its publication a version may still be loaded (on
            this host's monotonic clock; across hosts, counted from its arrival).
        stale_toleration: iterations a receiver may go on with the weights it has.
        event_name: DI-engine's bus topic; here it names the exchanger in warnings.
        model_loader: must be None (see :class:`ModelExchanger`).
        channel: as for :class:`ModelExchanger`.
        backend: as for :class:`ModelExchanger` (the sender is the learner).
        learner_rank: as for :class:`ModelExchanger`.
        timeout: as for :class:`ModelExchanger`.
        copy: as for :class:`ModelExchanger` (receivers).

    Raises:
        ValueError: an unknown mode, a period below 1, a negative toleration.

    Example:
        ```python
        import torch
        import torch_mp_ext as mp

        def evaluator(channel):
            model = torch.nn.Linear(4, 2)
            models = mp.PeriodicalModelExchanger(model, "receive", channel=channel)
            assert models.receive(timeout=60) is not None   # a fresh version, loaded

        if __name__ == "__main__":
            model = torch.nn.Linear(4, 2)
            channel = mp.StateDictChannel(model)
            models = mp.PeriodicalModelExchanger(model, "send", period=2, channel=channel)
            assert models.send() is not None   # iteration 0: a multiple of 2, published
            assert models.send() is None   # iteration 1: not
            p = mp.Process(target=evaluator, args=(channel,))
            p.start()
            p.join(60)
            assert p.exitcode == 0
        ```
    """

    def __init__(self, model: torch.nn.Module, mode: str, period: int = 1,
                 delay_toleration: float = math.inf, stale_toleration: int = 1,
                 event_name: str = "model_exchanger", model_loader: Any = None, *,
                 channel: StateDictChannel | None = None, backend: str = "shm",
                 learner_rank: int = 0, timeout: float | None = DEFAULT_TIMEOUT,
                 copy: bool = True) -> None:
        check_loader(model_loader, "model_loader")
        self._mode = check_role(mode, ("send", "receive"), "mode")
        self._copy = check_copy(copy, mode == "receive", backend)
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be a positive integer, got {period!r}")
        if not delay_toleration >= 0 or not stale_toleration >= 0:
            raise ValueError("delay_toleration and stale_toleration must be >= 0, got "
                             f"{delay_toleration!r} and {stale_toleration!r}")
        self._model = model
        self._role = "learner" if mode == "send" else "collector"
        self._period = period
        self._delay_toleration = delay_toleration
        self._stale_toleration = stale_toleration
        self._channel = model_transport(model, channel, backend, mode == "send", learner_rank)
        self._name = event_name
        self.timeout = timeout
        self._id_counter = 0 if mode == "send" else -1
        self._model_id = -1
        self._model_stale = stale_toleration
        self._time = -math.inf  # monotonic publication time of the newest version seen

    @property
    def model_id(self) -> int:
        """The version loaded (receivers); -1 before the first."""
        return self._model_id

    @property
    def model_stale(self) -> int:
        """Iterations since the last load, counting the one of the load as 1 (receivers)."""
        return self._model_stale

    def send(self) -> int | None:
        """Sender: ends one iteration; publishes it if it is a multiple of ``period``.

        Returns:
            The version (the iteration's index) published, or None.
        """
        if self._mode != "send":
            raise RuntimeError("send() is the sender's; this exchanger's mode is 'receive'")
        sent = None
        if self._id_counter % self._period == 0:
            sent = self._channel.publish(self._model, self._id_counter)
        self._id_counter += 1
        return sent

    def receive(self, timeout: float | None = _DEFAULT) -> int | None:
        """Receiver: loads a fresh version, reuses the current weights, or waits (above).

        Returns:
            The version loaded, or None when the weights were reused, the wait timed out
            (after DI-engine's warning, naming this process) or the channel is closed.

        Raises:
            PeerDiedError: the sender died without closing the channel.
        """
        if self._mode != "receive":
            raise RuntimeError("receive() is the receiver's; this exchanger's mode is 'send'")
        self._channel.check_peer()
        timeout = self._timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        newer_than = self._model_id
        while True:
            found = self._channel.peek(self._model_id, multiple_of=self._period)
            if found is not None:
                version, age = found
                self._time = time.monotonic() - age
                self._id_counter = version
                if age < self._delay_toleration:
                    try:
                        self._model_id = self._load(self._model_id, multiple_of=self._period,
                                                    timeout=0)
                    except TimeoutError:
                        continue  # overwritten since the peek by versions of other periods
                    self._model_stale = 1
                    return self._model_id
                newer_than = version  # too old to load: wait for a fresher one
            elif self._channel.closed:
                return None
            elif (self._model_stale < self._stale_toleration
                  and time.monotonic() - self._time < self._delay_toleration):
                self._model_stale += 1
                return None
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._channel.wait(newer_than, multiple_of=self._period, timeout=left)
            except TimeoutError:
                self._warn_timeout(newer_than, timeout)
                self._model_stale += 1
                return None
            except ChannelClosedError:
                return None

    def __call__(self, ctx: Any) -> Generator[None, None, None]:
        """DI-engine's middleware: receivers update before every step but the first, the
        sender publishes after the step every ``period`` iterations."""
        if self._mode == "receive":
            if ctx.total_step != 0:  # Skip first iteration
                self.receive()
        else:
            yield
            self.send()
