"""What ``multiprocessing.pool.Pool`` and ``ProcessPoolExecutor`` need of a SimpleQueue.

Note [SimpleQueue internals that the standard library uses]
``multiprocessing.pool.Pool`` (3.8-3.13) and ``concurrent.futures.ProcessPoolExecutor`` take
their SimpleQueues from the context and then reach inside them: ``_writer.send`` puts,
``_reader.recv`` gets, ``_reader.poll()`` peeks, ``_reader.close()``/``_writer.close()`` are
called in workers, ``_rlock`` is acquired on terminate, and ``_reader`` is waited on with
``multiprocessing.connection.wait`` beside process sentinels, so it needs a ``fileno()`` that
becomes readable when an item arrives from any process. This mixin provides exactly those,
over the ring, so the standard Pool runs unchanged on torch_mp_ext's queues (no CPython
method is overridden).

The ``fileno()`` is a doorbell (kept by the core in every put and get), off until the first
``fileno()`` (or waiting ``poll()``) in any process arms it: a non-blocking pipe shared by
every process holding the queue (inherited on fork, passed as ``DupFd`` when pickled) and a
word in shared memory naming the process that owes the pipe a byte (Note [Doorbell] in
``csrc/queue/ring.h``). A put rings (writes one byte) only when it takes the word (clear, or
naming a dead process); a get claims the word, empties the pipe, then writes a byte if items
remain, or else clears the word and re-checks like a put. Any interleaving of these steps
leaves the pipe readable whenever an item is queued, and the pipe never holds more than a
few bytes. A process SIGKILLed between two of those steps leaves the word naming a dead
process (or clear) and perhaps no byte: the next put, get, or ``fileno()`` call
(``multiprocessing.connection.wait`` asks for it each time it starts waiting) rings again.
Gets by processes that never look at ``_reader`` keep it honest too, so a waiter never spins
on a stale byte for long.
"""

from __future__ import annotations

import multiprocessing.util
import os
import queue
import select
import threading
from multiprocessing import reduction
from typing import Any, Optional

__all__ = ["SimpleQueueCompat"]

#: Steps of the doorbell protocol where the test hook ``_C.Ring.set_crash_point`` SIGKILLs
#: this process (tests/test_crash_consistency.py), like the ring's own crash points.
CRASH_RING_NO_BYTE = 6  # a put took the doorbell word, before its byte
CRASH_GET_DRAINED = 7  # a get claimed the word and emptied the pipe, before re-ringing


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class _End:
    """What both ends share: closing one closes only that end (as a worker's
    ``_writer.close()`` does in ``multiprocessing.pool``); closing the queue closes both."""

    def __init__(self, q: Any) -> None:  # a SimpleQueueCompat, which is a _RingQueue
        self._q = q
        self._own_closed = False

    @property
    def closed(self) -> bool:
        return self._own_closed or self._q._closed

    def close(self) -> None:
        self._own_closed = True


class _Writer(_End):
    """``SimpleQueue._writer``: ``send`` puts; ``close`` closes only this end."""

    readable = False
    writable = True

    def send(self, obj: Any) -> None:
        self._q.put(obj)


class _Reader(_End):
    """``SimpleQueue._reader``: what a ``multiprocessing.connection.Connection`` reader offers
    (``recv``, ``poll``, ``fileno``, ``closed``, ``close``); waitable with
    ``multiprocessing.connection.wait``."""

    readable = True
    writable = False

    def _check(self) -> None:
        if self.closed:
            raise OSError("handle is closed")  # what a closed Connection raises

    def recv(self) -> Any:
        q = self._q
        if q._rlock.locked():
            # Pool._help_stuff_finish (terminate) holds _rlock and calls recv() after poll()
            # said an item is there. Our workers' gets do not take _rlock (it is a thread
            # lock: Note [SimpleQueue internals that the standard library uses]), so one may
            # take that item first: then there is nothing to remove, and waiting would hang
            # the terminate for ever.
            try:
                return q.get(False)
            except queue.Empty:
                return None
        return q.get()

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        self._check()
        q = self._q
        if q._ring.qsize() > 0:
            return True
        if timeout is not None and timeout <= 0:
            return False
        q._ring.watch_doorbell()  # arms it (Note [Doorbell]) and rings for an item just put
        if q._ring.qsize() > 0:
            return True
        select.select([q._doorbell[0]], [], [], timeout)
        return q._ring.qsize() > 0

    def fileno(self) -> int:
        self._check()
        q = self._q
        try:  # Note [Doorbell]: arm it, and repair what a killed process left
            q._ring.watch_doorbell()
        except ValueError:  # this queue object was closed: nothing to repair through it
            pass
        return q._doorbell[0]



class SimpleQueueCompat:
    """Mixin for SimpleQueue (Note [SimpleQueue internals that the standard library uses])."""

    _ring: Any
    _doorbell: tuple

    def _setup(self, ring: Any) -> None:
        super()._setup(ring)  # type: ignore[misc]
        self._rlock = threading.Lock()
        self._wlock = None
        self._reader = _Reader(self)
        self._writer = _Writer(self)

    def _set_doorbell(self, read_fd: int, write_fd: int) -> None:
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self._doorbell = (read_fd, write_fd)
        self._ring.set_doorbell(read_fd, write_fd)  # every put and get keep it from now on
        self._doorbell_finalizer = multiprocessing.util.Finalize(
            self, _close_fds, args=(read_fd, write_fd))

    def _new_doorbell(self) -> None:
        self._set_doorbell(*os.pipe())

    def _doorbell_fds(self) -> tuple:
        """What pickling the queue sends of its doorbell (``_set_doorbell`` on arrival)."""
        r, w = self._doorbell
        return reduction.DupFd(r), reduction.DupFd(w)

    def close(self) -> None:
        """Closes this process's handle of the queue (and its wake-up pipe); the queue
        lives on in the other processes holding it. Any later call on this handle raises
        ``ValueError``, as the standard library's does."""
        super().close()  # type: ignore[misc]
        self._doorbell_finalizer()
