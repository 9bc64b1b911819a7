"""Lending CUDA blocks to other processes: our counter slots on top of torch's CUDA IPC.

Note [CUDA lifetimes]
torch's ``_share_cuda_()`` already keeps a sent block alive: it swaps the storage's DataPtr for
a wrapper W owning the caching-allocator block, with a slot T of torch's own counter file set
to 1; when the storage dies while T > 0, W moves to torch's "limbo" and is freed by a later
collect once T is 0. torch_mp_ext layers its own counting on that, without owning memory:

 producer A                                    receiver B                  third process C
 ┌────────────────────────────────────────┐    ┌────────────────────────┐  ┌────────────────┐
 │ storage S ── DataPtr: torch wrapper W  │    │ storage R = open(h,off)│  │ storage R'     │
 │              owns the CUDA block;      │◀IPC│ finalizer: sync stream,│  │ (forwarded by  │
 │              torch slot T = 1 while    │ h, │ slot 0 -= 1            │  │ B: same h,off) │
 │              A's record for tag 7 lives│ off└──────┬─────────────────┘  └──────┬─────────┘
 │ record tag 7: T, nbytes                │           │ claim, decrement          │
 │ counter file /torch_A_… (ours) ◀───────┼───────────┴───────────────────────────┘
 │   slot 0: tag 7, count 1, holder B     │
 │   slot 1: tag 7, count 1, holder C  ◀── acquired by B when it forwarded R
 └────────────────────────────────────────┘
 collect(): no slot tagged 7 is counted any more (released, or its holder died)
            → release T → torch frees the block at once if S is gone, else when S dies

1. torch owns the memory, always. We never free, and never hold, CUDA memory ourselves: no
   double free, and a storage that is resized or dies keeps its old block in W.
2. torch's T means one thing: "torch_mp_ext still needs this block". It is 1 from the send
   until our last slot for it goes, and only the producer touches it. Receivers get no torch
   counter name, so torch's own receiver-side decrement does nothing: no double count.
3. Our slots count receivers: one per send (each send is a record with its own tag and its own
   W, as each torch send is), one per forward. The receiving process claims its slot (records
   its holder key) before anything else, and decrements it when its storage dies (after
   synchronising its current stream, as torch does), when it exits, or never if SIGKILLed --
   then the producer reclaims the slot once it sees the holder dead. A second receipt of the
   same block by one process reuses its storage and gives the new slot back at once.
4. Forwarding: a process holding a received storage acquires a new slot in the *original*
   producer's counter file with the same tag, before its own slot can go (it holds the storage
   while pickling). So a tag never looks dead while any process still holds the block
   (Note [Counter snapshots] in counters.h). The forwarder keeps its event until the slot goes.
5. Collection runs on sends (at most every 2 ms, counts only), every 50 ms in a background
   thread while anything is lent (also reclaiming dead holders' slots and dropping empty
   counter files), and on ``torch_mp_ext.cuda.ipc_collect()``.
6. Exit: a process first releases what it received, then waits up to 10 s
   (``torch_mp_ext.cuda.set_exit_wait``) for what it lent -- but only 2 s for blocks no process
   has received yet (a message left in an abandoned queue) -- and then warns with the blocks,
   bytes and holders still outstanding (never silently). Its counter files are unlinked;
   receivers that have them mapped keep decrementing harmlessly.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import time
import warnings
from typing import Any

import torch
from torch.multiprocessing.reductions import SharedCache, StorageWeakRef

from .. import _C
from .. import torch_internals as _ti
from ..errors import CudaSharingWarning
from .backend import Backend, Shared, TorchCuda
from .borrower import Borrower, Received
from .lender import Forwarded, Lender, holder_alive, holder_pid

__all__ = [
    "TICKET",
    "Backend",
    "Shared",
    "collect",
    "get_exit_wait",
    "is_ticket",
    "receive",
    "send",
    "set_backend",
    "set_exit_wait",
    "stats",
]

_log = logging.getLogger("torch_mp_ext.cuda")

TICKET = "tmx-cuda"
#: As torch's CUDA_IPC_MAXIMUM_EVENTS_TO_USE: beyond it forwards synchronise instead.
MAX_FORWARD_EVENTS = 1000


def _env_seconds(name: str, default: float) -> float | None:
    raw = os.environ.get(name, str(default)).strip().lower()
    if raw in ("none", "inf", "forever"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        _log.warning("%s=%r is not a number of seconds >= 0 (or 'none' to wait forever); "
                     "using %g", name, raw, default)
        return default
    return value


_exit_wait = _env_seconds("TORCH_MP_EXT_CUDA_EXIT_WAIT_S", 10.0)
_exit_wait_unreceived = _env_seconds("TORCH_MP_EXT_CUDA_EXIT_WAIT_UNRECEIVED_S", 2.0)
_backend: Backend = TorchCuda()
_cache = SharedCache()  # (IPC handle, offset) -> StorageWeakRef: one storage per block


def set_backend(backend: Backend) -> None:
    """Replaces the CUDA calls (tests without a GPU install a fake)."""
    global _backend
    _backend = backend


def get_exit_wait() -> tuple[float | None, float | None]:
    return _exit_wait, _exit_wait_unreceived


def _check_seconds(seconds: Any, what: str) -> float | None:
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"{what} must be a number of seconds >= 0 or None (no limit), got "
                         f"{seconds!r}")
    return float(seconds)


def set_exit_wait(seconds: float | None, unreceived: float | None) -> None:
    global _exit_wait, _exit_wait_unreceived
    _exit_wait, _exit_wait_unreceived = (_check_seconds(seconds, "the exit wait"),
                                         _check_seconds(unreceived, "the unreceived wait"))


def _current_backend() -> Backend:
    return _backend


_borrower = Borrower(_current_backend)
_lender = Lender(_current_backend, lambda name: _borrower.unref(name))


# ---- what the reducers call ----------------------------------------------------------------


def is_ticket(ref_counter_handle: Any) -> bool:
    """True for our keep-alive reference (torch sends its counter file's name as bytes)."""
    return isinstance(ref_counter_handle, tuple) and ref_counter_handle[:1] == (TICKET,)


def send(storage: torch.UntypedStorage) -> tuple:
    """Lends a non-empty CUDA storage to one receiver (or forwards a received one).

    Returns:
        ``(device, handle, nbytes, offset, ticket, slot, event_handle, event_sync)``, the
        storage part of :func:`~torch_mp_ext.reductions.rebuild_cuda_tensor`'s arguments
        (``ticket`` and ``slot`` travel as torch's ``ref_counter_handle``/``_offset``).
    """
    received = _borrower.lookup(storage)
    if received is not None:
        return _forward(received)
    shared = _backend.share(storage)
    try:
        counters, slot, generation, tag = _lender.lend(shared)
    except BaseException:
        _backend.release_native(shared.native)
        raise
    _cache[(shared.handle, shared.offset)] = StorageWeakRef(storage)
    ticket = (TICKET, counters.name, counters.segment_id, generation, tag, counters.owner_key,
              os.getpid())
    return (shared.device, shared.handle, shared.nbytes, shared.offset, ticket, slot,
            shared.event_handle, shared.event_sync)


def _forward(received: Received) -> tuple:
    _, name, segment_id, _, tag, owner_key, _ = received.ticket
    producer = holder_pid(owner_key)
    if not holder_alive(owner_key):
        raise RuntimeError(
            f"Cannot send this CUDA tensor on: it was received from process {producer}, which "
            "allocated its memory and has exited, so the memory is gone. Clone tensors "
            "(t.clone()) while their producer is alive and send the clones.")
    counters = _borrower.counters(name, segment_id, owner_key)
    slot = None
    try:
        got = counters.acquire(1, tag)
        if got is None:
            raise RuntimeError(
                f"Cannot send this CUDA tensor on: the keep-alive file /dev/shm{name} of "
                f"process {producer}, which allocated it, has all {counters.capacity} slots "
                "in use. Clone the tensor (t.clone()) and send the clone.")
        slot, generation = got
        if len(_lender.forwarded) >= MAX_FORWARD_EVENTS:
            _backend.synchronize(received.device)
            event, event_handle, event_sync = None, bytes(64), False
        else:
            event, event_handle, event_sync = _backend.record_event(received.device)
    except BaseException:
        if slot is not None:
            counters.add(slot, -1)
        _borrower.unref(name)
        raise
    _lender.add_forwarded(Forwarded(name, counters, slot, generation, event, received.nbytes))
    ticket = (TICKET, name, segment_id, generation, tag, owner_key, os.getpid())
    return (received.device, received.handle, received.nbytes, received.offset, ticket, slot,
            event_handle, event_sync)


_preservation_checked = False


def _check_storage_preservation() -> None:
    """A received slot is released when its storage's Python object dies, which is when the
    storage dies only if torch keeps storage objects alive with their storage (PyObject
    preservation, torch >= 2.1). Without it the slot would go while tensors still use the
    block: refuse instead."""
    global _preservation_checked
    if _preservation_checked:
        return
    import weakref

    storage = torch.UntypedStorage(8)
    tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
    ref = weakref.ref(storage)
    del storage
    if ref() is None:
        raise RuntimeError(
            f"torch {torch.__version__} does not keep a storage's Python object alive with "
            "the storage, which torch_mp_ext needs to know when a received CUDA tensor is "
            "gone: receive CUDA tensors with torch >= 2.1.")
    del tensor
    _preservation_checked = True


def receive(device: int, handle: bytes, nbytes: int, offset: int, ticket: tuple, slot: int,
            event_handle: bytes | None, event_sync: bool | None) -> torch.UntypedStorage:
    """The storage for a lent block: the one this process already has for it, or a new one
    whose death gives the slot back (Note [CUDA lifetimes])."""
    _check_storage_preservation()
    owner_key, sender_pid = ticket[5], ticket[6]
    key = (handle, offset)

    def wait_for_sender() -> None:
        if event_sync and event_handle is not None and sender_pid != os.getpid():
            _backend.wait_event(device, event_handle)

    lease = _borrower.lease(ticket, slot, device, wait_for_sender)
    try:
        ref = _cache.get(key)
        storage = None if ref is None else _ti.new_with_weak_ptr(ref.cdata)
        if storage is not None:
            lease.release(synchronize=False)  # the storage here already holds a slot
            return storage
        if owner_key == _C.holder_key():
            raise RuntimeError(
                "A CUDA tensor came back to the process that allocated it after the storage "
                "it was sent from had been freed; CUDA cannot reopen a process's own IPC "
                "handles. Keep the original tensor alive while its copies travel, or send a "
                "clone.")
        storage = _backend.open(device, handle, nbytes, offset)
    except BaseException:
        lease.release(synchronize=False)
        raise
    _borrower.attach(storage, Received(handle, offset, nbytes, device, ticket, storage, lease))
    _cache[key] = StorageWeakRef(storage)
    return storage


def collect() -> int:
    """Releases every block no process uses any more; returns how many."""
    released = _lender.collect(check_holders=True, drop_files=True)
    _borrower.close_idle()
    return released


def stats() -> dict[str, int]:
    """Counts for tests and diagnostics (see ``torch_mp_ext.cuda.ipc_stats``)."""
    with _lender.lock:
        records = [r for records in _lender.lent.values() for r in records.values()]
        out = {
            "lent_blocks": len(records),
            "lent_bytes": sum(r.nbytes for r in records),
            "forwarded_blocks": len(_lender.forwarded),
            "counter_files": len(_lender.files),
            "released_blocks": _lender.released,
            "reclaimed_slots": _lender.reclaimed,
        }
    with _borrower.lock:
        out["received_storages"] = len(_borrower.received)
        out["held_slots"] = len(_borrower.leases)
        out["mapped_counter_files"] = len(_borrower.files) + len(_borrower.idle)
    return out


def _at_exit() -> None:
    _borrower.release_all()
    start = time.monotonic()
    if _lender.pending() and not _lender.wait(_exit_wait, _exit_wait_unreceived):
        warnings.warn(_lender.describe(time.monotonic() - start), CudaSharingWarning,
                      stacklevel=1)
    _lender.close()
    _borrower.close_idle()


def _register_exit_hook() -> None:
    # After the queues flushed (-5) and children were joined; before the arena's (-100).
    multiprocessing.util.Finalize(None, _at_exit, exitpriority=-60)


def _after_fork_in_child() -> None:
    # A forked child owns none of the parent's sends or receipts: it starts afresh (the
    # parent's leases check their pid, so copies dying here release nothing), and CUDA
    # storages inherited through fork are unusable, so none is found in the cache either.
    global _lender, _borrower
    dict.clear(_cache)
    _borrower = Borrower(_current_backend)
    _lender = Lender(_current_backend, lambda name: _borrower.unref(name))


_register_exit_hook()
multiprocessing.util.register_after_fork(_register_exit_hook, lambda _: _register_exit_hook())
os.register_at_fork(after_in_child=_after_fork_in_child)
