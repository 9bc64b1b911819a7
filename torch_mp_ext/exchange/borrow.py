"""Reading a :class:`~torch_mp_ext.StateDictChannel`'s versions in place, without a copy.

A collector that borrows a version pins its buffer and makes its model's parameters and
buffers views of it; taking the next version pins the new buffer and rebinds the same
tensors (one ``set_`` each: Note [Borrow plans]), whatever the size of the state::

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
A borrow pins one buffer (a reader slot: ``begin_read`` without the copy) as a ``_C.Pin``:
an object that exports the buffer's bytes and unpins when its last reference goes. The
pin is wrapped in a storage of its own (``torch.frombuffer``, whose storage holds the
object it was made from), and every tensor of the borrowed version is a view of that
storage: the pin lasts exactly as long as any view of the version lives -- in the model, in
a state_dict the caller kept, in an autograd graph that saved a weight -- and no longer. So
taking the next version costs no copy and needs no bookkeeping of who still looks at the
old one: rebinding the model drops the old views, the old storage dies with its last view,
and its pin goes, without a line of Python. Only the pinning process unpins: a forked child
inherits the views but not the reader slot (the pin checks the pid), and a process that
dies holding a pin leaves it to the writer's dead-holder reclaim.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from .. import torch_internals as _internals
from ..errors import BorrowedWriteError
from .layout import Entry

__all__ = ["borrow", "borrow_into", "release", "unbind", "bump_versions", "contiguous_strides",
           "places"]

_VERSION = operator.attrgetter("_version")
_DTYPE = operator.attrgetter("dtype")
_IS_CPU = operator.attrgetter("is_cpu")


class StateDictChannel(Protocol):
    """What reading in place uses of a :class:`~torch_mp_ext.StateDictChannel`."""

    _channel: Any  # the _C.LatestChannel
    _entries: list[Entry]
    _label: str
    _watch: Any  # its PublisherWatch
    # id(tensor) -> (weakref, its plan's versions, index in them) of tensors bound to a
    # borrowed version: the autograd version each had when last rebound
    _borrowed: dict[int, tuple[weakref.ref[torch.Tensor], list[int], int]]
    _plans: weakref.WeakKeyDictionary  # module -> its _Plan (Note [Borrow plans])
    _places: list[tuple[int, tuple[int, ...], tuple[int, ...]]]  # places(_entries)

    def _check(self, status: int, newer_than: int, timeout: float | None) -> None: ...

    def _match(self, state: Mapping, verb: str) -> list[torch.Tensor]: ...


def _pin(ch: StateDictChannel, newer_than: int, multiple_of: int,
         timeout: float | None) -> tuple[int, torch.UntypedStorage]:
    """Pins the newest version above ``newer_than``: ``(version, a storage over it)``."""
    ch._watch.ensure()
    status, version, pin = ch._channel.pin(newer_than, multiple_of, timeout, ch._label)
    if pin is None:
        ch._check(status, newer_than, timeout)  # raises, naming the cause
    if ch._channel.buffer_bytes == 0:  # nothing to view (every tensor is empty)
        return version, torch.UntypedStorage(0)
    # the storage holds the pin, and the pin goes with the storage (Note [Pin lifetime])
    return version, torch.frombuffer(pin, dtype=torch.uint8).untyped_storage()


def places(entries: list[Entry]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """``(offset in elements, shape, strides)`` of each entry in a buffer: ``set_``'s
    arguments (the channel computes them once)."""
    return [(e.offset // _itemsize(e.dtype), e.shape, contiguous_strides(e.shape))
            for e in entries]


def borrow(ch: StateDictChannel, newer_than: int, multiple_of: int,
           timeout: float | None) -> tuple[int, dict[str, torch.Tensor]]:
    """``(version, state_dict)`` of views of the pinned version (StateDictChannel.borrow)."""
    version, storage = _pin(ch, newer_than, multiple_of, timeout)
    return version, {e.key: torch.empty(0, dtype=e.dtype).set_(storage, *place)
                     for e, place in zip(ch._entries, ch._places)}


class _Plan:
    """How to rebind one target's tensors, kept between versions (Note [Borrow plans]).

    Note [Borrow plans]
    Taking a version rebinds every tensor of the model, and a collector does it once per
    version, woken with cold caches among many collectors on few cores: so the checks that
    find the model's tensors (``state_dict(keep_vars=True)``, the keys, shapes, dtypes,
    devices) run once per model, and later versions only confirm that the module tree is
    the same objects -- every child, parameter and buffer container with the same length
    and the same entries (``torch_internals.module_structure``) -- and that no tensor
    changed dtype or device (``model.half()`` keeps the Parameter objects). Then each
    tensor is rebound by one ``set_`` (which also bumps its autograd version), and a
    borrow costs a few microseconds per tensor. A model whose tree changed is planned
    again from its state_dict. Planned on every call instead: a state_dict target (a dict
    cannot be weakly keyed), and a module whose ``state_dict()`` returns tensors it did not
    register as parameters or buffers (its own override: the tree says nothing of them).
    """

    __slots__ = ("tensors", "dtypes", "versions", "containers", "lengths", "dicts", "names",
                 "objects")

    def __init__(self, ch: StateDictChannel, target: Any) -> None:
        self.tensors = _live_tensors(ch, target, "borrow_into")
        _check_writes(ch, self.tensors, "borrow_into")  # against the registrations so far
        self.dtypes = [t.dtype for t in self.tensors]
        self.versions = list(map(_VERSION, self.tensors))  # after the last rebinding
        _forget_dead(ch)
        for i, t in enumerate(self.tensors):  # the versions list, not the plan: a plan
            ch._borrowed[id(t)] = (weakref.ref(t), self.versions, i)  # holds its tensors
        containers, entries = ([], []) if not isinstance(
            target, torch.nn.Module) else _internals.module_structure(target)
        self.containers = containers
        self.lengths = list(map(len, containers))
        self.dicts, self.names, self.objects = (
            [list(x) for x in zip(*entries)] if entries else ([], [], []))

    def fits(self) -> bool:
        """The target still has these tensors, with the dtypes and device planned (loops
        in C: Note [Borrow plans])."""
        return (list(map(len, self.containers)) == self.lengths
                and all(map(operator.is_, map(dict.get, self.dicts, self.names), self.objects))
                and list(map(_DTYPE, self.tensors)) == self.dtypes
                and all(map(_IS_CPU, self.tensors)))


def _plan(ch: StateDictChannel, target: Any) -> _Plan:
    plan = ch._plans.get(target) if isinstance(target, torch.nn.Module) else None
    if plan is None or not plan.fits():
        plan = _Plan(ch, target)
        registered = {id(obj) for obj in plan.objects}
        if plan.containers and all(id(t) in registered for t in plan.tensors):
            ch._plans[target] = plan  # else a state_dict of other tensors: planned each time
    return plan


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
        _, versions, i = seen
        if t._version != versions[i]:
            written.append(e.key)
            versions[i] = t._version  # reported once
    if written:
        raise BorrowedWriteError(
            f"{verb}: {written} were written in place while they viewed a version borrowed "
            f"from {ch._label}: that shared memory is read by every collector that borrowed "
            "the version, so borrowed tensors must not be written. Call model.eval() "
            "(BatchNorm updates its running statistics in train mode) and keep optimizers "
            "off a borrowing model; a model that changes its weights must copy them "
            "(read_into, or an exchanger with copy=True)")


def _forget_dead(ch: StateDictChannel) -> None:
    for key in [k for k, (ref, _, _) in ch._borrowed.items() if ref() is None]:
        del ch._borrowed[key]


def borrow_into(ch: StateDictChannel, target: Any, newer_than: int, multiple_of: int,
                timeout: float | None) -> int:
    """Rebinds ``target``'s tensors to views of the newest version (``borrow_into``)."""
    plan = _plan(ch, target)
    if list(map(_VERSION, plan.tensors)) != plan.versions:  # written in place?
        _check_writes(ch, plan.tensors, "borrow_into")
    version, storage = _pin(ch, newer_than, multiple_of, timeout)
    with torch.no_grad():
        for t, place in zip(plan.tensors, ch._places):
            t.set_(storage, *place)  # O(1), and bumps the autograd version (Note [Borrow plans])
    plan.versions[:] = map(_VERSION, plan.tensors)
    return version


def release(ch: StateDictChannel, target: Any) -> bool:
    """Gives ``target`` private copies of its borrowed tensors (StateDictChannel.release)."""
    tensors = _live_tensors(ch, target, "release")
    _check_writes(ch, tensors, "release")
    ch._plans.clear()  # a later borrow_into plans (and registers) afresh
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
    unbound = False
    with torch.no_grad():
        for t in state.values():
            if not isinstance(t, torch.Tensor):
                continue
            seen = ch._borrowed.get(id(t))
            if seen is None or seen[0]() is not t:
                continue
            del ch._borrowed[id(t)]
            t.data = torch.empty_like(t)
            unbound = True
    if unbound:
        ch._plans.clear()  # a later borrow_into plans (and registers) afresh


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
