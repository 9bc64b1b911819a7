"""The producer side of Note [CUDA lifetimes]: sends, forwards, collection, the exit report.

A :class:`Lender` owns this process's counter files. Each send of a CUDA block is a
:class:`Lent` record (its tag, size and torch's keep-alive), released once
``CounterFile.collect`` reports its tag dead; each forward of a received block is a
:class:`Forwarded` record that keeps the forwarder's event until the receiver has waited on it.
A daemon thread collects while anything is lent.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any, Callable

from .. import _C
from .backend import Backend, Shared

__all__ = ["Forwarded", "Lender", "Lent", "holder_alive", "holder_pid", "human_size",
           "settings"]

_log = logging.getLogger(__name__)


class settings:
    #: Slots per counter file (torch uses 10,000 int64s; ours are 32-byte slots, collected
    #: often, so fewer suffice and a collection stays short).
    slots_per_file = 1024
    #: Background collection period while anything is lent.
    collect_interval_s = 0.05
    #: Sends collect (counts only) at most this often.
    send_collect_interval_s = 0.002


def holder_pid(key: int) -> int:
    """The pid in a holder key (pid << 32 | start time)."""
    return key >> 32


def holder_alive(key: int) -> bool:
    """True if the process a holder key names is alive (a reused pid does not count)."""
    return _C.process_alive(holder_pid(key), key & 0xFFFFFFFF)


def human_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


class Lent:
    """One send of a block this process allocated: kept while a slot tagged ``tag`` counts."""

    __slots__ = ("native", "nbytes", "tag")

    def __init__(self, tag: int, nbytes: int, native: Any) -> None:
        self.tag, self.nbytes, self.native = tag, nbytes, native


class Forwarded:
    """One forward of a block this process received: keeps its event until the receiver has
    waited on it (it claims its slot right after) or the slot went."""

    __slots__ = ("counters", "event", "file_name", "generation", "nbytes", "slot")

    def __init__(self, file_name: str, counters: Any, slot: int, generation: int,
                 event: Any, nbytes: int) -> None:
        self.file_name, self.counters, self.slot = file_name, counters, slot
        self.generation, self.event, self.nbytes = generation, event, nbytes

    def done(self) -> bool:
        c = self.counters
        return (c.generation(self.slot) != self.generation or c.value(self.slot) <= 0
                or c.holder(self.slot) != 0)


class Lender:
    """This process's counter files, the sends they count, and the collector thread.

    Args:
        backend: returns the :class:`~torch_mp_ext.cuda.backend.Backend` to call.
        forward_done: called with the counter file name of each finished forward (the
            borrower holds a reference to that file for it); it must not wait for this
            lender's lock.
    """

    def __init__(self, backend: Callable[[], Backend], forward_done: Callable[[str], None]
                 ) -> None:
        self.backend, self.forward_done = backend, forward_done
        self.lock = threading.RLock()
        self.wakeup = threading.Condition(self.lock)
        self.files: dict[str, Any] = {}  # name -> CounterFile (ours), newest last
        self.lent: dict[str, dict[int, Lent]] = {}  # file name -> tag -> send
        self.forwarded: list[Forwarded] = []
        self.tags = itertools.count(1)
        self.thread: threading.Thread | None = None
        self.closed = False
        self.last_collect = 0.0
        self.released = 0
        self.reclaimed = 0

    def pending(self) -> int:
        return sum(len(records) for records in self.lent.values()) + len(self.forwarded)

    def lend(self, shared: Shared) -> tuple[Any, int, int, int]:
        """Counts a new send: (counter file, slot, generation, tag)."""
        with self.lock:
            if self.closed:
                raise RuntimeError("torch_mp_ext cannot share CUDA tensors from a process "
                                   "that is exiting (its exit already waited for receivers)")
            if time.monotonic() - self.last_collect >= settings.send_collect_interval_s:
                self.collect(check_holders=False)
            tag = next(self.tags)
            counters, slot, generation = self._acquire(tag)
            self.lent[counters.name][tag] = Lent(tag, shared.nbytes, shared.native)
            self._start_collector()
        return counters, slot, generation, tag

    def _acquire(self, tag: int) -> tuple[Any, int, int]:
        for attempt in range(2):
            for counters in reversed(list(self.files.values())):
                got = counters.acquire(1, tag)
                if got is not None:
                    return counters, got[0], got[1]
            if attempt == 0 and self.files:
                self.collect(check_holders=True)
        counters = _C.CounterFile.create(settings.slots_per_file)
        self.files[counters.name] = counters
        self.lent[counters.name] = {}
        got = counters.acquire(1, tag)
        if got is None:  # a fresh file is empty: cannot happen
            raise RuntimeError(f"a new counter file /dev/shm{counters.name} has no free slot")
        return counters, got[0], got[1]

    def add_forwarded(self, forwarded: Forwarded) -> None:
        with self.lock:
            self.forwarded.append(forwarded)
            self._start_collector()

    def collect(self, check_holders: bool, drop_files: bool = False) -> int:
        """Releases the sends no slot counts any more; returns how many."""
        released: list[Lent] = []
        finished: list[Forwarded] = []
        with self.lock:
            self.last_collect = time.monotonic()
            for name, counters in list(self.files.items()):
                records = self.lent[name]
                stable, dead, reclaimed, _ = counters.collect(check_holders)
                released += [records.pop(tag) for tag in dead if tag in records]
                for slot, holder, tag in reclaimed:
                    _log.info("reclaimed CUDA keep-alive slot %d of %s (tag %d): its holder, "
                              "process %d, died without releasing it", slot, name, tag,
                              holder_pid(holder))
                self.reclaimed += len(reclaimed)
                if drop_files and stable and not records and counters.in_use == 0:
                    del self.files[name], self.lent[name]
                    counters.unlink()
            if self.forwarded:
                still: list[Forwarded] = []
                for forwarded in self.forwarded:
                    (finished if forwarded.done() else still).append(forwarded)
                self.forwarded = still
            for record in released:
                try:
                    self.backend().release_native(record.native)
                except Exception:  # noqa: BLE001  (one failure must not keep the others)
                    _log.exception("releasing torch's keep-alive of a CUDA block failed")
            if released:
                self.backend().collect_native()
            self.released += len(released)
        for forwarded in finished:
            self.forward_done(forwarded.file_name)
        return len(released)

    def _start_collector(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._run, name="tmx-cuda-collector",
                                           daemon=True)
            self.thread.start()
        else:
            self.wakeup.notify()

    def _run(self) -> None:
        with self.lock:
            while not self.closed:
                if not self.pending():
                    self.wakeup.wait()
                    continue
                self.wakeup.wait(settings.collect_interval_s)
                if self.closed:
                    break
                try:
                    self.collect(check_holders=True, drop_files=True)
                except Exception:  # noqa: BLE001  (the thread must keep collecting)
                    _log.exception("collecting CUDA keep-alives failed")

    def received_tags(self) -> set[int]:
        """Tags of sends some process has claimed (received) and still holds."""
        with self.lock:
            return {tag for name, records in self.lent.items() if records
                    for _, tag, _, holder in self.files[name].counted_slots() if holder}

    def wait(self, timeout: float | None, unreceived: float | None) -> bool:
        """Collects until nothing is lent (True), or gives up (False) after ``timeout`` s, or
        after ``unreceived`` s once what is left was never received (messages nobody may
        ever get: an abandoned queue must not hold the process for the whole wait)."""
        start = time.monotonic()
        while True:
            self.collect(check_holders=True, drop_files=True)
            if not self.pending():
                return True
            elapsed = time.monotonic() - start
            if timeout is not None and elapsed >= timeout:
                return False
            if unreceived is not None and elapsed >= unreceived and not self.received_tags():
                return False
            # Justified sleep: at exit only, bounded by `timeout`; the counters live in other
            # processes' CUDA keep-alive slots, which no event of ours announces.
            time.sleep(0.01)

    def describe(self, waited: float) -> str:
        """The exit warning: what is still lent, and to whom."""
        holders: dict[int, int] = {}  # pid (0: not received yet) -> blocks
        blocks = nbytes = 0
        with self.lock:
            for name, records in self.lent.items():
                if not records:
                    continue
                pids: dict[int, set[int]] = {}
                for _, tag, _, holder in self.files[name].counted_slots():
                    pids.setdefault(tag, set()).add(holder_pid(holder))
                for tag, record in records.items():
                    blocks, nbytes = blocks + 1, nbytes + record.nbytes
                    for pid in pids.get(tag, {0}):
                        holders[pid] = holders.get(pid, 0) + 1
            for forwarded in self.forwarded:
                blocks, nbytes = blocks + 1, nbytes + forwarded.nbytes
                pid = holder_pid(forwarded.counters.holder(forwarded.slot))
                holders[pid] = holders.get(pid, 0) + 1
        who = ", ".join(
            (f"process {pid}" if pid else "no process yet (not received)") + f" ({n} block"
            + ("s)" if n > 1 else ")") for pid, n in sorted(holders.items(), key=lambda i: -i[0]))
        how_long = f"{waited:.1f} s"
        return (
            f"torch_mp_ext: process {os.getpid()} is exiting while {blocks} CUDA block(s) "
            f"({human_size(nbytes)}) it shared are still in use after waiting {how_long}; held by "
            f"{who}. Their memory goes away with this process: those processes will get CUDA "
            "errors or garbage if they use them. Keep the producer alive until consumers drop "
            "the tensors (for example, wait on an Event they set), send clones, or wait "
            "longer: torch_mp_ext.cuda.set_exit_wait(seconds) or TORCH_MP_EXT_CUDA_EXIT_WAIT_S."
        )

    def close(self) -> None:
        """At exit: stops the collector and removes the counter files' names."""
        with self.lock:
            self.closed = True
            self.wakeup.notify_all()
            for counters in self.files.values():
                counters.unlink()  # receivers that mapped it keep decrementing harmlessly
            thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(1.0)
