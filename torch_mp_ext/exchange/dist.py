"""The exchangers across hosts: ``torch.distributed`` in place of shared memory.

Note [Exchange over torch.distributed]
A collective needs every rank at the call, while a collector must never make the learner
wait for its step. So each receiving rank runs one thread that does nothing but take part
in the learner's broadcasts, and keeps what arrives as the newest version, exactly like a
StateDictChannel of one process::

   learner (rank 0)                            collector (rank r)
   publish(model, v):                          receiving thread:         read_into(model):
     pack state -> flat ──dist.broadcast──────▶ flat[back] (v, data)        lock, newest
     (header: v, flags)     (group of the       lock: front <-> back,       front -> model
                             exchanger)         version = v, arrival = now

The learner's rank broadcasts versions; collectors judge "newer" by version numbers and
"delay" from the arrival time on their own monotonic clock: no wall clock of another host
is ever compared. Contexts travel as pickled objects on two gloo groups: collectors send
theirs to the learner point to point (its thread receives from any source), the learner
broadcasts its own (each collector's thread receives). Each exchanger makes its own groups
(``dist.new_group``), so every rank must make its exchangers in the same order, and the
learner must ``close()`` them (a closed flag ends the receiving threads) before the process
group is destroyed. A receiving thread that fails instead (the learner was killed, its
connection went) leaves the exchange not closed but broken: ``finished`` and every wait raise
PeerDiedError, so a learner's death never reads as its finish.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ChannelClosedError, PeerDiedError
from .channel import layout, match_state, state_of

__all__ = ["DistContextChannel", "DistModelChannel"]

_HEADER = 64  # bytes before the tensors: int64 version, int64 flags
_CLOSED = 1
_BYE = "__torch_mp_ext_bye__"
_JOIN_TIMEOUT = 60.0


def _check_initialized(backend: str, is_learner: bool, learner_rank: int) -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"backend={backend!r} exchanges over torch.distributed, which is not initialised in "
            "this process: call torch.distributed.init_process_group() first (mp.launch() "
            "starts workers with the environment it reads)")
    rank = dist.get_rank()
    if is_learner != (rank == learner_rank):
        raise ValueError(
            f"rank {rank} is {'the learner' if is_learner else 'a receiver'} but "
            f"learner_rank={learner_rank}: exactly the learner's rank sends")
    return rank


def _recv_object_from_any(group: Any) -> Any:
    """One object sent by ``send_up`` from any rank (``recv_object_list`` of torch 2.13 needs
    the source rank)."""
    size = torch.empty(1, dtype=torch.int64)
    src = dist.recv(size, src=None, group=group)
    data = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.recv(data, src=src, group=group)
    return pickle.loads(data.numpy().tobytes())


class _Latest:
    """The newest received version and what waits for it (one process, several threads).

    ``closed`` is the learner's close only; a receiving thread that fails (the learner died,
    the connection went) records ``error`` instead, which every later wait and
    ``check_peer`` raises as PeerDiedError: a learner's death never reads as its finish.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.version = -1
        self.arrived = 0.0
        self.closed = False
        self.error: BaseException | None = None

    def wait_for(self, newer_than: int, multiple_of: int, timeout: float | None,
                 what: str) -> None:
        """Call with ``cond`` held; returns when a matching version is there."""
        def ready() -> bool:
            return (self.matches(newer_than, multiple_of) or self.closed
                    or self.error is not None)

        if not self.cond.wait_for(ready, timeout):
            raise TimeoutError(f"no version newer than {newer_than} arrived from {what} within "
                               f"{timeout} s (latest: {self.version}); is the learner sending?")
        if not self.matches(newer_than, multiple_of):
            self.check(what)
            raise ChannelClosedError(f"{what} is closed: the learner sends no more versions")

    def check(self, what: str) -> None:
        """Raises PeerDiedError if the receiving thread failed."""
        if self.error is not None:
            raise PeerDiedError(
                f"receiving from {what} failed, so the learner died or left the group without "
                f"closing the exchange ({type(self.error).__name__}: {self.error}); no version "
                f"newer than {self.version} will come. Restart the job (torchrun restarts the "
                "group), or end this process") from self.error

    def matches(self, newer_than: int, multiple_of: int) -> bool:
        return self.version > newer_than and self.version % multiple_of == 0

    def set(self, version: int) -> None:
        self.version, self.arrived = version, time.monotonic()
        self.cond.notify_all()

    def end(self, error: BaseException | None = None) -> None:
        with self.cond:
            if error is None:
                self.closed = True
            else:
                self.error = error
            self.cond.notify_all()


class DistModelChannel:
    """The StateDictChannel interface over a broadcast from the learner's rank."""

    def __init__(self, model: torch.nn.Module, *, backend: str, is_learner: bool,
                 learner_rank: int) -> None:
        _check_initialized(backend, is_learner, learner_rank)
        self.name = f"{backend} broadcast from rank {learner_rank}"
        self._src, self._is_learner = learner_rank, is_learner
        self._group = dist.new_group(backend=backend)
        state = model.state_dict()
        self._entries, nbytes = layout(state)
        self._index = {e.key: e for e in self._entries}
        first = next(iter(state.values()), None)
        self._device = first.device if first is not None else torch.device("cpu")
        if backend == "nccl" and self._device.type != "cuda":
            raise ValueError(f"backend='nccl' broadcasts CUDA tensors, but the model is on "
                             f"{self._device}: move it to its GPU first, or use 'gloo'")
        schema = [[(e.key, str(e.dtype), e.shape) for e in self._entries]]
        dist.broadcast_object_list(schema, src=learner_rank, group=self._group,
                                   device=self._device)
        if not is_learner:
            self._check_schema(schema[0])
        flats = 1 if is_learner else 2
        self._flats = [torch.zeros(_HEADER + nbytes, dtype=torch.uint8, device=self._device)
                       for _ in range(flats)]
        self._latest = _Latest()
        self._front = 0
        self._thread = None
        if not is_learner:
            self._thread = threading.Thread(target=self._receive_loop, daemon=True,
                                            name=f"torch_mp_ext {self.name}")
            self._thread.start()

    def _check_schema(self, theirs: list) -> None:
        mine = [(e.key, str(e.dtype), e.shape) for e in self._entries]
        for a, b in zip(theirs, mine):
            if tuple(a) != tuple(b):
                raise ValueError(f"the learner's state_dict has {a[0]!r}: {a[1]} {tuple(a[2])}, "
                                 f"this model has {b[0]!r}: {b[1]} {tuple(b[2])}")
        if len(theirs) != len(mine):
            raise ValueError(f"the learner's state_dict has {len(theirs)} tensors, this model "
                             f"{len(mine)}: every rank must build the same model")

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {e.key: flat[_HEADER + e.offset:_HEADER + e.offset + e.nbytes]
                .view(e.dtype).view(e.shape) for e in self._entries if e.nbytes}

    # ---- the learner ---------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._latest.version

    @property
    def closed(self) -> bool:
        return self._latest.closed

    def check_peer(self) -> None:
        self._latest.check(self.name)

    def publish(self, state: Any, version: int | None = None) -> int:
        if not self._is_learner:
            raise RuntimeError(f"only the learner's rank publishes on {self.name}")
        if self._latest.closed or self._latest.error is not None:
            raise ChannelClosedError(f"publish: {self.name} is closed")
        version = self._latest.version + 1 if version is None else version
        if version <= self._latest.version:
            raise ValueError(
                f"publish: version {version} is not newer than {self._latest.version}")
        sources = match_state(self._entries, self._index, state_of(state, "state"), "publish",
                              self.name)
        flat = self._flats[0]
        views = self._views(flat)
        with torch.no_grad():
            for e, src in zip(self._entries, sources):
                if e.nbytes:
                    views[e.key].copy_(src)
        self._send(flat, version, 0)
        self._latest.version, self._latest.arrived = version, time.monotonic()
        return version

    def _send(self, flat: torch.Tensor, version: int, flags: int) -> None:
        flat[:16].view(torch.int64).copy_(torch.tensor([version, flags], dtype=torch.int64))
        dist.broadcast(flat, src=self._src, group=self._group)

    def close(self) -> None:
        if self._is_learner:
            if not self._latest.closed:
                self._send(self._flats[0], self._latest.version, _CLOSED)
                self._latest.end()
        elif self._thread is not None:
            self._thread.join(_JOIN_TIMEOUT)

    # ---- the receivers -------------------------------------------------------------------

    def _receive_loop(self) -> None:
        back = 1
        try:
            while True:
                flat = self._flats[back]
                dist.broadcast(flat, src=self._src, group=self._group)
                if flat.is_cuda:
                    torch.cuda.current_stream(flat.device).synchronize()
                version, flags = flat[:16].view(torch.int64).tolist()
                if flags & _CLOSED:
                    self._latest.end()
                    return
                with self._latest.cond:  # readers copy under the lock: never from `back`
                    self._front, back = back, self._front
                    self._latest.set(version)
        except BaseException as exc:  # noqa: BLE001  (the learner died, the group went, ...)
            self._latest.end(exc)

    def peek(self, newer_than: int = -1, *, multiple_of: int = 1) -> tuple[int, float] | None:
        with self._latest.cond:
            if not self._latest.matches(newer_than, multiple_of):
                return None
            return self._latest.version, time.monotonic() - self._latest.arrived

    def wait(self, newer_than: int = -1, *, multiple_of: int = 1,
             timeout: float | None = None) -> int:
        with self._latest.cond:
            self._latest.wait_for(newer_than, multiple_of, timeout, self.name)
            return self._latest.version

    def republish(self, channel: Any, newer_than: int = -1,
                  timeout: float | None = None) -> int:
        """Publishes the newest version above ``newer_than`` through ``channel`` (a
        :class:`~torch_mp_ext.StateDictChannel` of the same template), under its own version
        number: one copy, from the buffer the broadcast landed in straight into the
        channel's (Note [Hierarchical exchange] in ``relay.py``).

        Raises:
            TimeoutError: nothing newer within ``timeout``.
            ChannelClosedError: the learner closed the exchange.
            PeerDiedError: the receiving thread failed (the learner died).
        """
        with self._latest.cond:
            self._latest.wait_for(newer_than, 1, timeout, self.name)
            version = self._latest.version
            channel.publish(self._views(self._flats[self._front]), version)
            return version

    def read_into(self, target: Any, newer_than: int = -1, *, multiple_of: int = 1,
                  timeout: float | None = None) -> int:
        dests = match_state(self._entries, self._index, state_of(target, "target"), "read_into",
                            self.name)
        with self._latest.cond:
            self._latest.wait_for(newer_than, multiple_of, timeout, self.name)
            views = self._views(self._flats[self._front])
            with torch.no_grad():
                for e, dst in zip(self._entries, dests):
                    if e.nbytes:
                        dst.copy_(views[e.key])
            return self._latest.version


class DistContextChannel:
    """Context payloads over gloo: collectors -> learner point to point, learner -> all by
    broadcast (Note [Exchange over torch.distributed])."""

    def __init__(self, *, is_learner: bool, learner_rank: int) -> None:
        _check_initialized("gloo", is_learner, learner_rank)
        self.name = f"context exchange with rank {learner_rank}"
        self._src, self._is_learner = learner_rank, is_learner
        self._up = dist.new_group(backend="gloo")
        self._down = dist.new_group(backend="gloo")
        self._peers = dist.get_world_size() - 1
        self._inbox: queue.Queue = queue.Queue()
        self._latest = _Latest()
        self._payload: Any = None
        target = self._receive_up if is_learner else self._receive_down
        self._thread = threading.Thread(target=target, daemon=True,
                                        name=f"torch_mp_ext {self.name}")
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._latest.closed

    def check_peer(self) -> None:
        self._latest.check(self.name)

    def _receive_up(self) -> None:
        byes = 0
        try:
            while byes < self._peers:
                item = _recv_object_from_any(self._up)
                if isinstance(item, str) and item == _BYE:
                    byes += 1
                else:
                    self._inbox.put(item)
        except BaseException as exc:  # noqa: BLE001  (handed to the waiting thread)
            self._inbox.put(exc)

    def _receive_down(self) -> None:
        try:
            while True:
                box: list = [None]
                dist.broadcast_object_list(box, src=self._src, group=self._down)
                version, payload = box[0]
                if isinstance(payload, str) and payload == _BYE:
                    self._latest.end()
                    return
                with self._latest.cond:
                    self._payload = payload
                    self._latest.set(version)
        except BaseException as exc:  # noqa: BLE001  (handed to the waiting thread)
            self._latest.end(exc)

    def send_up(self, payload: Mapping) -> None:
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=self._src, group=self._up)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=self._src,
                  group=self._up)

    def receive_up(self, timeout: float | None) -> list:
        """Blocks for one payload (up to ``timeout``), then takes every one already there."""
        try:
            items = [self._inbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if isinstance(item, BaseException):
                raise PeerDiedError(f"receiving contexts on {self.name} failed: {item}") from item
        return items

    def send_down(self, payload: Mapping) -> None:
        self._latest.version += 1
        dist.broadcast_object_list([(self._latest.version, payload)], src=self._src,
                                   group=self._down)

    def receive_down(self, newer_than: int, timeout: float | None) -> tuple[int, Any]:
        with self._latest.cond:
            self._latest.wait_for(newer_than, 1, timeout, self.name)
            return self._latest.version, self._payload

    def close(self) -> None:
        if self._is_learner:
            if not self._latest.closed:
                dist.broadcast_object_list([(self._latest.version, _BYE)], src=self._src,
                                           group=self._down)
                self._latest.end()
            self._thread.join(_JOIN_TIMEOUT)
        else:
            if not getattr(self, "_said_bye", False):
                self._said_bye = True
                self.send_up(_BYE)  # type: ignore[arg-type]
            self._thread.join(_JOIN_TIMEOUT)
