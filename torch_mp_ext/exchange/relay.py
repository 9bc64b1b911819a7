"""The hierarchical exchange: one network copy per host, shared memory on it: :class:`HostRelay`.

Note [Hierarchical exchange]
Over ``torch.distributed`` every receiving rank gets the whole state_dict from the network:
with N collectors on a host, the learner's broadcast carries N copies to it. Instead, one
rank per host (a *relay*) takes part in the broadcast, and republishes each version through a
:class:`~torch_mp_ext.StateDictChannel` on its host, which the host's collectors (processes
the relay started, holding :attr:`HostRelay.channel`) read like any shared-memory channel::

  host A                                   host B
  learner (rank 0) ──dist.broadcast──┬──▶ relay (rank 2) ──publish──▶ StateDictChannel ──▶ 3
  relay (rank 1) ◀───────────────────┘    (one copy in)                                collectors
     └─publish─▶ StateDictChannel ──▶ 3 collectors

- The learner does not change: ``ModelExchanger(model, role="learner", backend="gloo")``
  broadcasts to every other rank, and every other rank is a relay (launch one rank per
  host besides the learner: ``nprocs=2`` on the learner's host, 1 on the others).
- Versions keep their numbers; the channel's guarantees hold on each host (every read is
  one whole version; a collector never goes backwards) because the relay publishes under
  the broadcast's own lock from the buffer that holds the newest complete version
  (``DistModelChannel.republish``): one copy per host, through the channel's public API,
  so collectors read in whatever mode the channel offers.
- The learner's finish reaches collectors as the channel's close. Its death must not read
  as a finish (``ModelExchanger.finished``): the relay first records it in a small status
  channel, then closes; :class:`HostChannel` (what collectors get) checks that status
  wherever a plain channel would report ``closed``, and raises
  :class:`~torch_mp_ext.errors.PeerDiedError`. The relay's own death is the channel's
  publisher's death (Note [Publisher death] in ``csrc/exchange/latest.h``).
- Contexts (``contexts=True``) take the same road: the relay's threads forward what its
  collectors put on a :class:`~torch_mp_ext.ContextChannel` up to the learner
  (``DistContextChannel.send_up``) and republish the learner's broadcast payloads down
  through it; :class:`HostContextChannel` checks the learner's fate as :class:`HostChannel`
  does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ChannelClosedError, PeerDiedError
from .channel import StateDictChannel, state_of
from .context import ContextChannel
from .dist import DistContextChannel, DistModelChannel

__all__ = ["HostChannel", "HostContextChannel", "HostRelay"]

_RUNNING, _FINISHED, _DIED = 0, 1, 2
_STOP = "__torch_mp_ext_relay_stop__"  # put on the local up queue: the up thread ends


class _LearnerStatus:
    """The learner's fate as the relay saw it, in a small channel the relay publishes."""

    def __init__(self, channel: StateDictChannel) -> None:
        self.channel = channel

    def code(self) -> tuple[int, str]:
        try:
            _, state = self.channel.read(timeout=0)
        except TimeoutError:  # nothing published yet: the learner is running
            return _RUNNING, ""
        text = bytes(state["text"][:int(state["nbytes"][0])].tolist())
        return int(state["code"][0]), text.decode(errors="replace")

    def check(self, name: str, version: int) -> None:
        code, text = self.code()
        if code == _DIED:
            raise PeerDiedError(
                f"the learner died without closing the exchange, as the relay publishing "
                f"{name!r} saw it: {text}. No version newer than {version} will come; "
                "restart the job (or let torchrun's max_restarts do it)")


class HostChannel:
    """What a host's collectors read: the relay's :class:`StateDictChannel`, plus the
    learner's fate (Note [Hierarchical exchange]).

    Pass it as ``channel=`` to :class:`~torch_mp_ext.ModelExchanger` or
    :class:`~torch_mp_ext.PeriodicalModelExchanger` (``backend="shm"``, the default). It
    pickles to child processes under every start method. Methods it does not define are the
    channel's.

    Args:
        channel: the host's channel (made by :class:`HostRelay`).
        status: the learner's fate as the relay saw it (made by :class:`HostRelay`).

    Example:
        ```python
        import torch
        import torch.distributed as dist
        import torch_mp_ext as mp

        def collector(channel):                 # a process on the relay's host
            model = torch.nn.Linear(4, 2)
            models = mp.ModelExchanger(model, role="collector", channel=channel)
            while not models.finished:          # PeerDiedError if the learner died
                models.receive(timeout=60)
            print("collector has bias", model.bias.tolist())

        def host(local_rank):
            dist.init_process_group("gloo")
            model = torch.nn.Linear(4, 2)
            if dist.get_rank() == 0:            # the learner
                models = mp.ModelExchanger(model, role="learner", backend="gloo")
                for step in range(1, 4):
                    with torch.no_grad():
                        model.bias.fill_(step)
                    models.send()
                models.close()
            else:                               # this host's relay: one network copy
                relay = mp.HostRelay(model)
                ctx = mp.get_context("forkserver")
                p = ctx.Process(target=collector, args=(relay.channel,))
                p.start()
                relay.join()                    # until the learner closes
                p.join(60)
                relay.close()
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.launch(host, nprocs=2)
        ```
    """

    def __init__(self, channel: StateDictChannel, status: _LearnerStatus) -> None:
        self.channel = channel
        self._status = status
        self.name = channel.name

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("channel", "_status"):
            raise AttributeError(name)
        return getattr(self.channel, name)

    def __repr__(self) -> str:
        return f"<HostChannel of {self.channel!r}>"

    def check_peer(self) -> None:
        """Raises PeerDiedError if the relay died, or the learner died (as the relay saw)."""
        self.channel.check_peer()
        self._status.check(self.name, self.channel.version)

    @property
    def closed(self) -> bool:
        """True once the learner closed the exchange (not when it died: check_peer)."""
        return self.channel.closed and self._status.code()[0] == _FINISHED

    @contextlib.contextmanager
    def _closed_or_died(self) -> Iterator[None]:
        """A read of the channel: its close may be the learner's death, not a finish."""
        try:
            yield
        except ChannelClosedError:
            self.check_peer()  # raises PeerDiedError if the learner died
            raise

    def wait(self, newer_than: int = -1, *, multiple_of: int = 1,
             timeout: float | None = None) -> int:
        with self._closed_or_died():
            return self.channel.wait(newer_than, multiple_of=multiple_of, timeout=timeout)

    def read_into(self, target: Any, newer_than: int = -1, *, multiple_of: int = 1,
                  timeout: float | None = None) -> int:
        with self._closed_or_died():
            return self.channel.read_into(target, newer_than, multiple_of=multiple_of,
                                          timeout=timeout)

    def read(self, newer_than: int = -1, *, multiple_of: int = 1,
             timeout: float | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        with self._closed_or_died():
            return self.channel.read(newer_than, multiple_of=multiple_of, timeout=timeout)

    def borrow_into(self, target: Any, newer_than: int = -1, *, multiple_of: int = 1,
                    timeout: float | None = None) -> int:
        with self._closed_or_died():
            return self.channel.borrow_into(target, newer_than, multiple_of=multiple_of,
                                            timeout=timeout)

    def borrow(self, newer_than: int = -1, *, multiple_of: int = 1,
               timeout: float | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        with self._closed_or_died():
            return self.channel.borrow(newer_than, multiple_of=multiple_of, timeout=timeout)

    def _claim_publisher(self) -> None:
        raise ValueError(f"{self.name!r} is a host relay's channel: the learner exchanges "
                         "over torch.distributed (backend='gloo'), not through it")

    def close(self) -> None:
        """Nothing for a collector to let go of (the relay closes the channel)."""


class HostContextChannel:
    """What a host's collectors pass as ``ContextExchanger(..., channel=...)``: the relay's
    :class:`~torch_mp_ext.ContextChannel` plus the learner's fate (Note [Hierarchical
    exchange]). Pickles to child processes.

    Args:
        channel: the host's context channel (made by ``HostRelay(..., contexts=True)``).
        status: the learner's fate as the relay saw it (made by :class:`HostRelay`).

    Example:
        ```python
        import torch
        import torch.distributed as dist
        import torch_mp_ext as mp

        from torch_mp_ext.exchange import Context

        def collector(channel):                   # relay.context_channel: a HostContextChannel
            contexts = mp.ContextExchanger(role="collector", channel=channel)
            contexts.send(Context(total_step=0, env_step=64))   # up through the relay

        def host(local_rank):
            dist.init_process_group("gloo")
            model = torch.nn.Linear(4, 2)
            if dist.get_rank() == 0:              # the learner
                models = mp.ModelExchanger(model, role="learner", backend="gloo")
                contexts = mp.ContextExchanger(role="learner", backend="gloo")
                ctx = Context()
                contexts.receive(ctx, timeout=60)  # merges the collector's payload
                print("learner got env_step", ctx.env_step)
                models.close()                    # the relays' join() returns
                contexts.close()                  # waits for every relay's close()
            else:
                relay = mp.HostRelay(model, contexts=True)
                p = mp.get_context("forkserver").Process(
                    target=collector, args=(relay.context_channel,))
                p.start()
                p.join(60)
                relay.join()
                relay.close()
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.launch(host, nprocs=2)
        ```
    """

    def __init__(self, channel: ContextChannel, status: _LearnerStatus) -> None:
        self.channel = channel
        self._status = status
        self.name = channel.name

    def check_peer(self) -> None:
        """Raises PeerDiedError if the relay died, or the learner died (as the relay saw)."""
        self.channel.check_peer()
        self._status.check(self.name, -1)

    @property
    def closed(self) -> bool:
        """True once the learner closed the exchange (not when it died: check_peer)."""
        return self.channel.closed and self._status.code()[0] == _FINISHED

    def send_up(self, payload: dict) -> None:
        self.channel.send_up(payload)

    def receive_up(self, timeout: float | None) -> list:
        raise RuntimeError(f"{self.name!r} is a host relay's: only collectors use it")

    def receive_down(self, newer_than: int, timeout: float | None) -> tuple[int, Any]:
        try:
            return self.channel.receive_down(newer_than, timeout)
        except ChannelClosedError:
            self.check_peer()  # a learner's death closes the channel too: not a finish
            raise

    def _claim_learner(self) -> None:
        raise ValueError(f"{self.name!r} is a host relay's channel: the learner exchanges "
                         "over torch.distributed (backend='gloo'), not through it")

    def close(self) -> None:
        """Nothing for a collector to let go of (the relay closes the channel)."""


class HostRelay:
    """This host's receiver of the learner's broadcast, republishing it in shared memory.

    Make one on each host's relay rank, after ``init_process_group``, at the point where the
    learner makes its ``ModelExchanger(..., backend="gloo")`` (and, with ``contexts=True``,
    its ``ContextExchanger(..., backend="gloo")`` right after: exchangers are made in one
    order on every rank). Start the host's collectors with :attr:`channel` (and
    :attr:`context_channel`).

    Args:
        model: a model (or state_dict) of the learner's layout.
        backend: ``"gloo"`` or ``"nccl"`` (a model on a GPU), as the learner's.
        learner_rank: the learner's rank.
        buffers: the host channel's buffers (see :class:`StateDictChannel`).
        name: names the host channel.
        contexts: also relay contexts: the learner's down to the host's collectors, theirs
            up to the learner (:attr:`context_channel`).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: this rank is the learner's, or the model differs from the learner's.
    Example:
        ```python
        import torch
        import torch.distributed as dist
        import torch_mp_ext as mp

        def collector(channel):                 # a process on the relay's host
            model = torch.nn.Linear(4, 2)
            models = mp.ModelExchanger(model, role="collector", channel=channel)
            while not models.finished:          # PeerDiedError if the learner died
                models.receive(timeout=60)
            print("collector has bias", model.bias.tolist())

        def host(local_rank):
            dist.init_process_group("gloo")
            model = torch.nn.Linear(4, 2)
            if dist.get_rank() == 0:            # the learner
                models = mp.ModelExchanger(model, role="learner", backend="gloo")
                for step in range(1, 4):
                    with torch.no_grad():
                        model.bias.fill_(step)
                    models.send()
                models.close()
            else:                               # this host's relay: one network copy
                relay = mp.HostRelay(model)
                ctx = mp.get_context("forkserver")
                p = ctx.Process(target=collector, args=(relay.channel,))
                p.start()
                relay.join()                    # until the learner closes
                p.join(60)
                relay.close()
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.launch(host, nprocs=2)
        ```
    """

    def __init__(self, model: Any, *, backend: str = "gloo", learner_rank: int = 0,
                 buffers: int = 3, name: str | None = None, contexts: bool = False) -> None:
        template = state_of(model, "model")
        module = model if isinstance(model, torch.nn.Module) else _Holder(template)
        self._net = DistModelChannel(module, backend=backend, is_learner=False,
                                     learner_rank=learner_rank)
        self._net_ctx = (DistContextChannel(is_learner=False, learner_rank=learner_rank)
                         if contexts else None)
        cpu = {k: t.detach().to("cpu") for k, t in template.items()}
        shm = StateDictChannel(cpu, buffers=buffers, name=name)
        status = StateDictChannel({"code": torch.zeros(1, dtype=torch.int64),
                                   "nbytes": torch.zeros(1, dtype=torch.int64),
                                   "text": torch.zeros(1024, dtype=torch.uint8)},
                                  buffers=2, name=f"{shm.name} (learner status)")
        shm._claim_publisher()  # collectors can tell this relay's death from the start
        status._claim_publisher()
        self._shm, self._status = shm, status
        self.channel = HostChannel(shm, _LearnerStatus(status))
        self._ctx: ContextChannel | None = None
        self.context_channel: HostContextChannel | None = None
        self.error: BaseException | None = None
        self._ending, self._ended = threading.Lock(), False
        threads: list[tuple[str, Any, tuple]] = [("relay", self._relay, ())]
        if self._net_ctx is not None:
            self._ctx = ContextChannel(name=f"{shm.name} contexts")
            self._ctx._claim_learner()
            self.context_channel = HostContextChannel(self._ctx, _LearnerStatus(status))
            threads += [("contexts down", self._relay_down, (self._net_ctx, self._ctx)),
                        ("contexts up", self._relay_up, (self._net_ctx, self._ctx))]
        self._threads = [threading.Thread(target=target, args=args, daemon=True,
                                          name=f"torch_mp_ext {what} of {shm.name}")
                         for what, target, args in threads]
        for t in self._threads:
            t.start()

    @property
    def version(self) -> int:
        """The newest version republished on this host."""
        return self._shm.version

    def _relay(self) -> None:
        version = -1
        try:
            while True:
                version = self._net.republish(self._shm, version)
        except ChannelClosedError:
            self._end(_FINISHED, "")
        except BaseException as exc:  # noqa: BLE001  (recorded for collectors and join())
            self._end(_DIED, f"{type(exc).__name__}: {exc}", exc)

    def _relay_down(self, net: DistContextChannel, local: ContextChannel) -> None:
        version = -1
        try:
            while True:
                version, payload = net.receive_down(version, None)
                local.send_down(payload)
        except ChannelClosedError:
            local.close()
        except BaseException as exc:  # noqa: BLE001  (recorded for collectors and join())
            self._end(_DIED, f"{type(exc).__name__}: {exc}", exc)

    def _relay_up(self, net: DistContextChannel, local: ContextChannel) -> None:
        try:
            while True:
                for item in local.receive_up(None):
                    if isinstance(item, str) and item == _STOP:
                        return
                    net.send_up(item)
        except BaseException as exc:  # noqa: BLE001  (recorded for collectors and join())
            self._end(_DIED, f"{type(exc).__name__}: {exc}", exc)

    def _end(self, code: int, text: str, error: BaseException | None = None) -> None:
        with self._ending:
            if self._ended:  # the first thread to see the end says what it was
                return
            self._ended = True
            self.error = error
            data = text.encode()[:1024]
            buf = torch.zeros(1024, dtype=torch.uint8)
            buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
            self._status.publish({"code": torch.tensor([code]),
                                  "nbytes": torch.tensor([len(data)]), "text": buf})
            self._shm.close()
            if self._ctx is not None and code == _DIED:
                self._ctx.close()
            self._status.close()

    def join(self, timeout: float | None = None) -> bool:
        """Waits until the learner finished (True) or ``timeout`` passed (False).

        Raises:
            PeerDiedError: the learner died (or its connection went) without closing.
        """
        self._threads[0].join(timeout)
        if self._threads[0].is_alive():
            return False
        if self.error is not None:
            if isinstance(self.error, PeerDiedError):
                raise self.error
            raise PeerDiedError(f"relaying {self._shm.name!r} failed: {self.error}") \
                from self.error
        return True

    def close(self) -> None:
        """Lets go of the broadcasts' receiving threads (after the learner closed)."""
        self._net.close()
        if self._ctx is not None and self._net_ctx is not None:
            self._ctx.send_up(_STOP)  # type: ignore[arg-type]
            self._threads[2].join()
            self._net_ctx.close()  # says goodbye to the learner, ends its down thread
        for t in self._threads:
            t.join()


class _Holder(torch.nn.Module):
    """A module whose state_dict is the given one (DistModelChannel takes a module)."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self._state = dict(state)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:  # type: ignore[override]
        return self._state
