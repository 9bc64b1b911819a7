"""The receiver side of Note [CUDA lifetimes]: claimed slots, received storages, release.

A :class:`Borrower` maps the counter files of the processes this one received CUDA blocks
from (a few stay mapped while idle), and remembers each storage it built on a received block,
so that the storage can be sent on (forwarded) and its death gives the slot back. A
:class:`Lease` is one claimed slot: released once, only by the process that claimed it (a
forked copy of it releases nothing), after synchronising the current stream.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .. import _C
from .backend import Backend
from .lender import holder_alive, holder_pid

__all__ = ["Borrower", "Lease", "Received", "open_counters"]

_log = logging.getLogger("torch_mp_ext.cuda")

#: Counter files of other processes kept mapped while no storage here uses them.
IDLE_FILES_KEPT = 8


class Lease:
    """One counted reference this process received (a claimed slot)."""

    __slots__ = ("borrower", "counters", "device", "file_name", "pid", "released", "slot")

    def __init__(self, borrower: Borrower, file_name: str, counters: Any, slot: int,
                 device: int) -> None:
        self.borrower = borrower
        self.file_name, self.counters, self.slot, self.device = file_name, counters, slot, device
        self.pid = os.getpid()
        self.released = False

    def release(self, synchronize: bool) -> None:
        """Gives the slot back, once, in the process that claimed it (not in forked copies)."""
        if self.pid != os.getpid():
            return  # a forked copy: neither the slot nor the (inherited) lock is ours
        borrower = self.borrower
        with borrower.lock:
            if self.released:
                return
            self.released = True
            borrower.leases.pop(id(self), None)
        try:
            if synchronize:  # the stream's work on the block must be done before it is reused
                borrower.backend().synchronize(self.device)
        finally:
            self.counters.add(self.slot, -1)
            borrower.unref(self.file_name)


class Received:
    """What a received storage was built from: enough to send it on (forward it)."""

    __slots__ = ("device", "handle", "lease", "nbytes", "offset", "ticket", "weak")

    def __init__(self, handle: bytes, offset: int, nbytes: int, device: int, ticket: tuple,
                 storage: torch.UntypedStorage, lease: Lease) -> None:
        self.handle, self.offset, self.nbytes, self.device = handle, offset, nbytes, device
        self.ticket, self.weak, self.lease = ticket, StorageWeakRef(storage), lease


class Borrower:
    """Counter files of other processes this process maps, and the storages it received.

    Args:
        backend: returns the :class:`~torch_mp_ext.cuda.backend.Backend` to call.
    """

    def __init__(self, backend: Callable[[], Backend]) -> None:
        self.backend = backend
        self.lock = threading.RLock()
        self.files: dict[str, list] = {}  # name -> [CounterFile, users]
        self.idle: OrderedDict[str, Any] = OrderedDict()
        self.received: dict[int, Received] = {}  # storage _cdata -> what it was built from
        self.leases: dict[int, Lease] = {}
        self.devices: set[int] = set()

    def counters(self, name: str, segment_id: int, owner_key: int) -> Any:
        """The counter file ``name`` mapped here, with one more user."""
        with self.lock:
            entry = self.files.get(name)
            if entry is None:
                counters = self.idle.pop(name, None)
                if counters is None or counters.segment_id != segment_id:
                    counters = open_counters(name, segment_id, owner_key)
                entry = self.files[name] = [counters, 0]
            entry[1] += 1
            return entry[0]

    def unref(self, name: str) -> None:
        with self.lock:
            entry = self.files.get(name)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self.files[name]
            self.idle[name] = entry[0]
            while len(self.idle) > IDLE_FILES_KEPT:
                self.idle.popitem(last=False)
            if not holder_alive(entry[0].owner_key):
                self.close_idle(dead_owners_only=True)

    def close_idle(self, dead_owners_only: bool = False) -> None:
        """Unmaps idle counter files (all, or those whose owner died); the names of dead
        owners' files are then removed if no live process maps them (reaped)."""
        with self.lock:
            dead = [n for n, c in self.idle.items() if not holder_alive(c.owner_key)]
            for name in dead if dead_owners_only else list(self.idle):
                del self.idle[name]
        if dead:
            _C.reap_dead_segments()

    def lease(self, ticket: tuple, slot: int, device: int, before_claim: Any = None) -> Lease:
        """Claims a received slot; ``before_claim()`` runs first (the event wait: a claimed
        slot tells a forwarder its event is no longer needed)."""
        _, name, segment_id, generation, _, owner_key, _ = ticket
        counters = self.counters(name, segment_id, owner_key)
        try:
            if counters.generation(slot) == generation and before_claim is not None:
                before_claim()
            if not counters.claim(slot, generation):
                raise RuntimeError(
                    f"A received CUDA tensor's keep-alive slot {slot} in /dev/shm{name} was "
                    f"already released and reused (stale message): its producer, process "
                    f"{holder_pid(owner_key)}, may have freed the memory. Do not unpickle one "
                    "message twice; send clones if the producer cannot wait.")
        except BaseException:
            self.unref(name)
            raise
        lease = Lease(self, name, counters, slot, device)
        with self.lock:
            self.leases[id(lease)] = lease
            self.devices.add(device)
        return lease

    def attach(self, storage: torch.UntypedStorage, received: Received) -> None:
        with self.lock:
            self.received[storage._cdata] = received
        finalizer = weakref.finalize(storage, _storage_died, storage._cdata, received.lease)
        finalizer.atexit = False  # the exit hook releases everything at once

    def forget(self, cdata: int, lease: Lease) -> None:
        with self.lock:
            entry = self.received.get(cdata)
            if entry is not None and entry.lease is lease:
                del self.received[cdata]

    def lookup(self, storage: torch.UntypedStorage) -> Received | None:
        with self.lock:
            received = self.received.get(storage._cdata)
        if received is None or received.weak.expired() or received.lease.pid != os.getpid():
            return None
        return received

    def release_all(self) -> None:
        """At exit: synchronise, then give back every slot still held."""
        with self.lock:
            leases, devices = list(self.leases.values()), sorted(self.devices)
        for device in devices if leases else ():
            try:
                self.backend().synchronize(device)
            except Exception:  # noqa: BLE001  (release anyway: the process is going)
                _log.exception("synchronising CUDA device %d at exit failed", device)
        for lease in leases:
            lease.release(synchronize=False)
        self.close_idle()


def open_counters(name: str, segment_id: int, owner_key: int) -> Any:
    try:
        return _C.CounterFile.open(name, segment_id)
    except (FileNotFoundError, RuntimeError) as exc:
        if holder_alive(owner_key) and not isinstance(exc, FileNotFoundError):
            raise
        raise RuntimeError(
            f"A CUDA tensor arrived after process {holder_pid(owner_key)}, which allocated it, "
            "had "
            f"exited: its keep-alive file /dev/shm{name} is gone, and so is the memory. Keep "
            "the producer alive until its tensors are received (at exit it waits a while: "
            "torch_mp_ext.cuda.set_exit_wait), or send clones."
        ) from exc


def _storage_died(cdata: int, lease: Lease) -> None:
    if lease.pid != os.getpid():
        return  # a forked copy: the parent's lease and locks are not this process's
    try:
        lease.borrower.forget(cdata, lease)
        lease.release(synchronize=True)
    except Exception:  # noqa: BLE001  (a finalizer cannot raise)
        _log.exception("releasing a received CUDA block failed")
