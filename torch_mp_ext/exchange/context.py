"""Context exchange between a learner and its collectors, DI-engine style.

Adapted from DI-engine's ``ding/framework/middleware/distributer.py`` (``ContextExchanger``),
keeping its arguments, hooks (``put``/``fetch``, ``_put_<key>``/``_fetch_<key>``) and
semantics; changes:

- the transport is a :class:`ContextChannel` made once in the parent: collectors' payloads
  go to the learner through a queue (nothing is lost, nothing merged twice), the learner's
  payload reaches every collector as the newest version of a small
  :class:`~torch_mp_ext.StateDictChannel` (``backend="gloo"``/``"nccl"``: over
  ``torch.distributed`` instead, Note [Exchange over torch.distributed]);
- a process's role is an argument (``"learner"`` or ``"collector"``);
- waits have timeouts: DI-engine's learner waits forever (``timeout=None``, the default for
  it), its collectors 60 s, then warn naming the process; a closed channel ends waits.

Each step, a collector merges the learner's newest payload (``train_iter``), waiting for a
new one once ``ctx.total_step >= skip_n_iter``, and after the step sends its trajectories,
episodes and the *increments* of ``env_step``/``env_episode``; the learner waits for at
least one collector payload, merges all that arrived (trajectories concatenated,
increments summed into its own counters) and after the step sends ``train_iter``::

    collector ──(trajectories, env_step +n)──▶ queue ──▶ learner: ctx.trajectories = [...]
    collector ◀──── newest {"train_iter": i} ──────────── learner     ctx.env_step += sum n
"""

from __future__ import annotations

import logging
import pickle
import queue
from collections.abc import Generator
from typing import Any

import torch

from ..errors import ChannelClosedError
from .channel import StateDictChannel
from .model import DEFAULT_TIMEOUT, check_loader, check_role, process_label

__all__ = ["ContextChannel", "ContextExchanger"]

logger = logging.getLogger("torch_mp_ext.exchange")
_DEFAULT: Any = object()


class ContextChannel:
    """What a learner and its collectors share for :class:`ContextExchanger` on one host.

    Make it in the parent and pass it to every process (as a ``Process`` argument, like any
    ``multiprocessing`` queue).

    Args:
        capacity: the most bytes the learner's pickled payload may take.
        ctx: the ``multiprocessing`` context whose ``Queue`` carries the collectors'
            payloads (default: torch_mp_ext's, so tensors in trajectories are shared, not
            copied).
        name: names the channel in errors.

    Example:
        ```python
        import torch_mp_ext as mp

        channel = mp.ContextChannel()   # made in the parent, passed to every process
        channel.send_up({"env_step": 64})   # a collector's payload
        assert channel.receive_up(timeout=60) == [{"env_step": 64}]
        channel.send_down({"train_iter": 1})   # the learner's
        version, payload = channel.receive_down(newer_than=-1, timeout=60)
        assert payload == {"train_iter": 1}
        channel.close()
        ```
    """

    def __init__(self, *, capacity: int = 1 << 16, ctx: Any = None,
                 name: str = "context channel") -> None:
        if ctx is None:
            from ..processes.context import default_context as ctx
        self.name = name
        self._up = ctx.Queue()
        template = {"nbytes": torch.zeros(1, dtype=torch.int64),
                    "payload": torch.zeros(capacity, dtype=torch.uint8)}
        self._down = StateDictChannel(template, name=f"{name} (learner to collectors)")
        self._capacity = capacity

    @property
    def closed(self) -> bool:
        """True once the learner closed the channel (not when it died)."""
        return self._down.closed

    def check_peer(self) -> None:
        """Raises PeerDiedError if the learner died without closing the channel."""
        self._down.check_peer()

    def _claim_learner(self) -> None:
        """The learner's exchanger records its process (Note [Publisher death])."""
        self._down._claim_publisher()

    def send_up(self, payload: dict) -> None:
        """Collector: queues ``payload`` (a dict of context fields) for the learner.

        Args:
            payload: picklable; its tensors and arrays travel through shared memory.
        """
        self._up.put(payload)

    def receive_up(self, timeout: float | None) -> list:
        """Learner: blocks for one payload, then takes every one already there.

        Args:
            timeout: most seconds to wait for the first payload (``None``: for ever).

        Returns:
            The payloads in the order they were sent; empty if ``timeout`` passed first.
        """
        try:
            items = [self._up.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._up.get_nowait())
            except queue.Empty:
                return items

    def send_down(self, payload: dict) -> None:
        """Learner: publishes ``payload`` as the newest version for every collector.

        Args:
            payload: picklable; replaces the previous one (collectors read the newest).

        Raises:
            ValueError: ``payload`` pickles to more than the channel's ``capacity`` bytes.
        """
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self._capacity:
            raise ValueError(
                f"the learner's context payload pickles to {len(data)} bytes, more than the "
                f"{self._capacity} {self.name} holds: make it with capacity >= {len(data)}")
        buf = torch.zeros(self._capacity, dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._down.publish({"nbytes": torch.tensor([len(data)]), "payload": buf})

    def receive_down(self, newer_than: int, timeout: float | None) -> tuple[int, Any]:
        """Collector: waits for a payload newer than version ``newer_than`` and reads it.

        Args:
            newer_than: the last version this collector read (``-1``: none yet).
            timeout: most seconds to wait (``None``: for ever).

        Returns:
            ``(version, payload)`` of the newest payload.

        Raises:
            TimeoutError: no newer version within ``timeout``.
            ChannelClosedError: the learner closed the channel and nothing newer is there.
            PeerDiedError: the learner died without closing it, and nothing newer is there.
        """
        version, state = self._down.read(newer_than, timeout=timeout)
        nbytes = int(state["nbytes"][0])
        return version, pickle.loads(state["payload"][:nbytes].numpy().tobytes())

    def close(self) -> None:
        """Learner: ends the channel; waiting collectors return and ``closed`` turns True."""
        self._down.close()


class ContextExchanger:
    """Exchanges context fields between the learner and its collectors (see the module).

    Args:
        skip_n_iter: a collector does not wait for the learner's payload while
            ``ctx.total_step < skip_n_iter`` (the learner needs data first). Ignored by the
            learner.
        storage_loader: DI-engine's ``StorageLoader``; must be None (payload tensors travel
            through shared memory already).
        role: ``"learner"`` or ``"collector"``.
        channel: the :class:`ContextChannel` shared by all (``backend="shm"``).
        backend: ``"shm"``, or ``"distributed"``/``"gloo"``/``"nccl"`` for
            ``torch.distributed`` (contexts always travel on gloo groups: they are Python
            objects).
        learner_rank: the learner's rank (distributed backends).
        timeout: seconds to wait for the other side; default: forever for the learner,
            60 s for collectors (DI-engine's).

    Raises:
        ValueError: an unknown role or backend, a missing channel, a storage loader.

    Example:
        ```python
        import torch_mp_ext as mp
        from torch_mp_ext.exchange import Context

        def collector(channel):
            contexts = mp.ContextExchanger(role="collector", channel=channel)
            ctx = Context(total_step=0, env_step=64)   # step 0: nothing to wait for yet
            contexts.send(ctx)   # the env_step increment goes to the learner

        if __name__ == "__main__":
            channel = mp.ContextChannel()
            contexts = mp.ContextExchanger(role="learner", channel=channel)
            p = mp.Process(target=collector, args=(channel,))
            p.start()
            ctx = Context()
            contexts.receive(ctx, timeout=60)   # merges what the collector sent
            p.join(60)
            assert ctx.env_step == 64
            contexts.close()
        ```
    """

    def __init__(self, skip_n_iter: int = 1, storage_loader: Any = None, *, role: str,
                 channel: ContextChannel | None = None, backend: str = "shm",
                 learner_rank: int = 0, timeout: float | None = _DEFAULT) -> None:
        check_loader(storage_loader, "storage_loader")
        self._role = check_role(role, ("learner", "collector"), "role")
        self._is_learner = role == "learner"
        self._state: dict[str, Any] = {}
        self._local_state: dict[str, int] = {}  # just save local state, not send to remote node
        if not self._is_learner:
            self._local_state["env_step"] = 0
            self._local_state["env_episode"] = 0
        self._skip_n_iter = skip_n_iter
        if timeout is _DEFAULT:
            timeout = None if self._is_learner else DEFAULT_TIMEOUT
        self.timeout: float | None = timeout
        self._seen = -1  # collectors: version of the learner's newest payload merged
        if backend == "shm":
            if channel is None:
                raise ValueError("backend='shm' needs channel=: make one ContextChannel() in the "
                                 "parent and pass it to the learner and every collector")
            self._channel: Any = channel
            if self._is_learner:
                channel._claim_learner()
        else:
            if backend not in ("distributed", "gloo", "nccl"):
                raise ValueError("backend must be 'shm', 'distributed', 'gloo' or 'nccl', got "
                                 f"{backend!r}")
            if channel is not None:
                raise ValueError(f"channel= is for backend='shm', not {backend!r}")
            from .dist import DistContextChannel

            self._channel = DistContextChannel(is_learner=self._is_learner,
                                               learner_rank=learner_rank)

    @property
    def finished(self) -> bool:
        """True once the learner closed the exchange.

        Raises:
            PeerDiedError: the learner died without closing it (not a finish).
        """
        self._channel.check_peer()
        return self._channel.closed

    # ---- plain calls ---------------------------------------------------------------------

    def receive(self, ctx: Any, timeout: float | None = _DEFAULT) -> bool:
        """Merges what the other side sent into ``ctx`` (DI-engine's ``merge``).

        The learner waits for at least one collector payload; a collector waits for a new
        learner payload once ``ctx.total_step >= skip_n_iter``. A wait that times out logs
        DI-engine's warning, naming this process, and merges nothing.

        Args:
            ctx: the step's context (``Context`` or any object with its fields).
            timeout: seconds (default: the exchanger's; ``None`` waits forever).

        Returns:
            True if anything was merged.
        """
        timeout = self.timeout if timeout is _DEFAULT else timeout
        if self._is_learner:
            payloads = self._channel.receive_up(timeout)
            if not payloads:
                self._warn(timeout)
            for payload in payloads:
                self.put(payload)
        else:
            wait = ctx.total_step >= self._skip_n_iter
            try:
                version, payload = self._channel.receive_down(self._seen, timeout if wait else 0)
            except TimeoutError:
                if wait:
                    self._warn(timeout)
            except ChannelClosedError:
                pass
            else:
                self._seen = version
                self.put(payload)
        merged = bool(self._state)
        for k, v in self._state.items():
            if self._is_learner and k.startswith("increment_"):
                pure_k = k.split("increment_")[-1]
                setattr(ctx, pure_k, getattr(ctx, pure_k) + v)
            else:
                setattr(ctx, k, v)
        self._state = {}
        return merged

    def send(self, ctx: Any) -> dict:
        """Sends this process's fields of ``ctx`` to the other side; returns the payload."""
        payload = self.fetch(ctx)
        if payload:
            if self._is_learner:
                self._channel.send_down(payload)
            else:
                self._channel.send_up(payload)
        return payload

    def close(self) -> None:
        """Learner: ends the exchange (collectors' waits return, ``finished`` turns True).
        Collectors: lets go of a ``torch.distributed`` backend's threads."""
        if self._is_learner or not isinstance(self._channel, ContextChannel):
            self._channel.close()

    def __call__(self, ctx: Any) -> Generator[None, None, None]:
        """DI-engine's middleware: merge, run the step, send."""
        self.receive(ctx)
        yield
        self.send(ctx)

    def _warn(self, timeout: float | None) -> None:
        logger.warning("Timeout when waiting for new context! Process %s got nothing from the "
                       "%s within %s s", process_label(self._role),
                       "collectors" if self._is_learner else "learner", timeout)

    # ---- DI-engine's hooks ----------------------------------------------------------------

    def put(self, payload: dict) -> None:
        """Takes a received payload in, one ``_put_<key>`` handler per key."""
        for key, item in payload.items():
            fn = getattr(self, f"_put_{key}", None)
            if fn is None:
                logger.warning("Receive unexpected key (%s) in context exchanger", key)
            else:
                fn(item)

    def fetch(self, ctx: Any) -> dict[str, Any]:
        """The payload to send: ``_fetch_<key>(ctx.<key>)`` for each field ``ctx`` has."""
        payload = {}
        for name in dir(self):
            if not name.startswith("_fetch_"):
                continue
            key = name[len("_fetch_"):]
            if hasattr(ctx, key):
                value = getattr(self, name)(getattr(ctx, key))
                if value is not None:
                    payload[key] = value
        return payload

    def _extend(self, key: str, items: list) -> None:
        if self._is_learner:
            self._state.setdefault(key, []).extend(items)

    def _put_trajectories(self, traj: list) -> None:
        self._extend("trajectories", traj)

    def _fetch_trajectories(self, traj: list) -> list | None:
        return None if self._is_learner else traj

    def _put_episodes(self, episodes: list) -> None:
        self._extend("episodes", episodes)

    def _fetch_episodes(self, episodes: list) -> list | None:
        return None if self._is_learner else episodes

    def _put_trajectory_end_idx(self, trajectory_end_idx: list) -> None:
        self._extend("trajectory_end_idx", trajectory_end_idx)

    def _fetch_trajectory_end_idx(self, trajectory_end_idx: list) -> list | None:
        return None if self._is_learner else trajectory_end_idx

    def _increment(self, key: str, value: int) -> None:
        if self._is_learner:
            self._state[f"increment_{key}"] = self._state.get(f"increment_{key}", 0) + value

    def _fetch_increment(self, key: str, value: int) -> int | None:
        if self._is_learner:
            return None
        increment = value - self._local_state[key]
        self._local_state[key] = value
        return increment

    def _put_env_step(self, increment_env_step: int) -> None:
        self._increment("env_step", increment_env_step)

    def _fetch_env_step(self, env_step: int) -> int | None:
        return self._fetch_increment("env_step", env_step)

    def _put_env_episode(self, increment_env_episode: int) -> None:
        self._increment("env_episode", increment_env_episode)

    def _fetch_env_episode(self, env_episode: int) -> int | None:
        return self._fetch_increment("env_episode", env_episode)

    def _put_train_iter(self, train_iter: int) -> None:
        if not self._is_learner:
            self._state["train_iter"] = train_iter

    def _fetch_train_iter(self, train_iter: int) -> int | None:
        return train_iter if self._is_learner else None
