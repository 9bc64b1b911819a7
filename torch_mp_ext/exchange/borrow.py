"""Reading a :class:`~torch_mp_ext.StateDictChannel`'s versions in place, without a copy.

A collector that borrows a version pins its buffer and makes its model's parameters and
buffers views of it; taking the next version pins the new buffer and rebinds the same
tensors (``.data``, O(1) each), whatever the size of the state::

      learner                    channel buffers (shared memory)         collector's model
  ch.publish(model) ──copy──▶  ┌──────────┬──────────┬──────────┐
                               │ v=7      │ v=6      │ (free)   │ ◀── fc.weight.data  (views,
                               │ pinned 2 │ pinned 1 │          │     fc.bias.data     pin on v=7)
                               └──────────┴──────────┴──────────┘

Rules (docs/exchange.md, "Reading in place"): the borrowed tensors are read-only by contract
(torch has no read-only tensors; an in-place write is found at the next borrow and raises
:class:`~torch_mp_ext.errors.BorrowedWriteError`), CPU only, and the channel's ``buffers``
bound the shared memory, however many collectors borrow (Note [Borrowed versions] in
``csrc/exchange/latest.h``).

Note [Pin lifetime]
A borrow pins one buffer (a reader slot: ``begin_read`` without the copy) and wraps the
buffer in a storage of its own: a uint8 numpy array over the block, then
``torch.from_numpy``; every tensor of the borrowed version is a view of that storage. The
storage holds the array, and ``weakref.finalize(array)`` unpins: the pin lasts exactly as
long as any view of the version lives -- in the model, in a state_dict the caller kept, in
an autograd graph that saved a weight -- and no longer. So taking the next version costs
no copy and needs no bookkeeping of who still looks at the old one: rebinding the model
drops the old views, the old storage dies with its last view, and its pin goes. Only the
pinning process unpins: a forked child inherits the views but not the reader slot (the
finalizer checks the pid), and a process that dies holding a pin leaves it to the writer's
dead-holder reclaim.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import BorrowedWriteError
from ..sharing import memory as _memory
from .layout import Entry

__all__ = ["borrow", "borrow_into", "release", "unbind", "bump_versions", "contiguous_strides"]

logger = logging.getLogger("torch_mp_ext.exchange")


class StateDictChannel(Protocol):
    """What reading in place uses of a :class:`~torch_mp_ext.StateDictChannel`."""

    _channel: Any  # the _C.LatestChannel
    _entries: list[Entry]
    _label: str
    _watch: Any  # its PublisherWatch
    # id(tensor) -> (weakref, autograd version) of tensors bound to a borrowed version
    _borrowed: dict[int, tuple[weakref.ref[torch.Tensor], int]]

    def _check(self, status: int, newer_than: int, timeout: float | None) -> None: ...

    def _match(self, state: Mapping, verb: str) -> list[torch.Tensor]: ...


def _unpin(raw: Any, index: int, slot: int, version: int, pid: int, label: str) -> None:
    """Note [Pin lifetime]: runs when the last view of a borrowed version dies."""
    if os.getpid() != pid:
        return  # a forked copy of the views: the pin is the parent's
    if not raw.end_read(index, slot, version):
        # Cannot happen unless a writer judged this live process dead (Note [Latest-value
        # channel]); a finalizer cannot raise, so it is logged, loudly.
        logger.error("version %d of %s changed while process %d borrowed it: a writer "
                     "misjudged this process dead; borrowed weights may have been torn",
                     version, label, pid)


def _pin(ch: StateDictChannel, newer_than: int, multiple_of: int,
         timeout: float | None) -> tuple[int, dict[str, torch.Tensor]]:
    """Pins the newest version above ``newer_than``: ``(version, views of it)``."""
    raw = ch._channel
    ch._watch.ensure()
    status, index, slot, version, _ = raw.begin_read(newer_than, multiple_of, timeout)
    ch._check(status, newer_than, timeout)
    try:
        array = _memory.array_from_block(raw.block, raw.buffer_offset(index),
                                         (raw.buffer_bytes,), np.dtype(np.uint8), None)
        storage = torch.from_numpy(array).untyped_storage()
    except BaseException:
        raw.end_read(index, slot, version)
        raise
    weakref.finalize(array, _unpin, raw, index, slot, version, os.getpid(), ch._label)
    del array  # from here on the storage alone keeps the pin (Note [Pin lifetime])
    views = {}
    for e in ch._entries:
        if e.nbytes == 0:
            views[e.key] = torch.empty(e.shape, dtype=e.dtype)
            continue
        views[e.key] = torch.empty(0, dtype=e.dtype).set_(
            storage, e.offset // _itemsize(e.dtype), e.shape, contiguous_strides(e.shape))
    return version, views


def borrow(ch: StateDictChannel, newer_than: int, multiple_of: int,
           timeout: float | None) -> tuple[int, dict[str, torch.Tensor]]:
    """``(version, state_dict)`` of views of the pinned version (StateDictChannel.borrow)."""
    return _pin(ch, newer_than, multiple_of, timeout)


def _live_tensors(ch: StateDictChannel, target: Any, verb: str) -> list[torch.Tensor]:
    """The target's own tensors in template order: a module's parameters and buffers
    themselves (``keep_vars=True``), not the detached aliases ``state_dict()`` returns."""
    state: Mapping
    if isinstance(target, torch.nn.Module):
        state = target.state_dict(keep_vars=True)
    elif isinstance(target, Mapping):
        state = target
    else:
        raise TypeError(f"target must be an nn.Module or a state_dict (a mapping of names to "
                        f"tensors), got {type(target).__name__}")
    ch._match(state, verb)  # keys, shapes and dtypes, or ValueError naming the key
    tensors = [state[e.key] for e in ch._entries]
    for e, t in zip(ch._entries, tensors):
        if t.device.type != "cpu":
            raise ValueError(
                f"{verb}: {e.key!r} is on {t.device}; a version read in place is CPU shared "
                "memory, so only CPU tensors can view it. Use read_into (copy=True) for a "
                "model on a GPU: one copy to the device")
        if t.is_inference():
            raise ValueError(
                f"{verb}: {e.key!r} is an inference tensor, whose storage cannot be rebound; "
                "make the model outside torch.inference_mode(), or use read_into")
    return tensors


def _check_writes(ch: StateDictChannel, tensors: list[torch.Tensor], verb: str) -> None:
    """Raises BorrowedWriteError if a tensor that views a borrowed version was written."""
    written = []
    for e, t in zip(ch._entries, tensors):
        seen = ch._borrowed.get(id(t))
        if seen is None or seen[0]() is not t:
            continue
        if t._version != seen[1]:
            written.append(e.key)
            ch._borrowed[id(t)] = (seen[0], t._version)  # reported once
    if written:
        raise BorrowedWriteError(
            f"{verb}: {written} were written in place while they viewed a version borrowed "
            f"from {ch._label}: that shared memory is read by every collector that borrowed "
            "the version, so borrowed tensors must not be written. Call model.eval() "
            "(BatchNorm updates its running statistics in train mode) and keep optimizers "
            "off a borrowing model; a model that changes its weights must copy them "
            "(read_into, or an exchanger with copy=True)")


def _forget_dead(ch: StateDictChannel) -> None:
    for key in [k for k, (ref, _) in ch._borrowed.items() if ref() is None]:
        del ch._borrowed[key]


def borrow_into(ch: StateDictChannel, target: Any, newer_than: int, multiple_of: int,
                timeout: float | None) -> int:
    """Rebinds ``target``'s tensors to views of the newest version (``borrow_into``)."""
    tensors = _live_tensors(ch, target, "borrow_into")
    _check_writes(ch, tensors, "borrow_into")
    version, views = _pin(ch, newer_than, multiple_of, timeout)
    with torch.no_grad():
        for e, t in zip(ch._entries, tensors):
            t.data = views[e.key]  # O(1): the same Parameter, now over the pinned buffer
    bump_versions(tensors)
    _forget_dead(ch)
    for t in tensors:
        ch._borrowed[id(t)] = (weakref.ref(t), t._version)
    return version


def release(ch: StateDictChannel, target: Any) -> bool:
    """Gives ``target`` private copies of its borrowed tensors (StateDictChannel.release)."""
    tensors = _live_tensors(ch, target, "release")
    _check_writes(ch, tensors, "release")
    moved = False
    with torch.no_grad():
        for t in tensors:
            seen = ch._borrowed.pop(id(t), None)
            if seen is not None and seen[0]() is t:
                t.data = t.data.clone()
                moved = True
    return moved


def unbind(ch: StateDictChannel, target: Any) -> None:
    """Before a copy into ``target`` (read_into): tensors still viewing a borrowed version
    get fresh private memory first (no copy: the read overwrites them), so the copy never
    writes into a version other collectors borrow."""
    if not ch._borrowed or not isinstance(target, (torch.nn.Module, Mapping)):
        return
    state: Mapping[str, Any] = (target.state_dict(keep_vars=True)
                                if isinstance(target, torch.nn.Module) else target)
    with torch.no_grad():
        for t in state.values():
            if not isinstance(t, torch.Tensor):
                continue
            seen = ch._borrowed.get(id(t))
            if seen is None or seen[0]() is not t:
                continue
            del ch._borrowed[id(t)]
            t.data = torch.empty_like(t)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def bump_versions(tensors: list[torch.Tensor]) -> None:
    """Bumps autograd's version counter of each tensor whose contents changed behind it."""
    # Autograd tracks in-place writes by version counters; a memcpy or a rebinding bypasses
    # them, so a graph that saved the old weights would otherwise compute its backward with
    # the new ones.
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        for t in tensors:
            if not t.is_inference():  # inference tensors have no version counter
                bump(t)
