"""Reading a :class:`~torch_mp_ext.TaskPool`'s result queue, and noticing dead workers, with
no thread awake while nothing happens.

Note [Who reads the result queue]
Whoever holds the pool's pump lock reads the result queue, blocked on its ring (a futex
condition: no CPU while nothing arrives) until a message comes, and handles every message it
finds, for any task, with ``STATE`` held; then it notifies ``STATE``. A value that arrives
while a caller waits for it (``get()``, ``next()``) should not need a second thread to wake
that caller: handing the GIL over between threads costs tens of microseconds, or a whole
switch interval (5 ms) from a busy thread. So a waiting caller reads the queue itself, and
the collector thread reads it only while no caller waits (``_waiters``) nor did in the last
``_GRACE_S`` (a burst of ``get()`` calls keeps the pump). A caller that finds the collector
blocked on the queue (``_collector_reading``, set and read under ``_turn`` with
``_waiters``: one of them always sees the other) posts a ``WAKE``; the collector gives the
pump up and notifies ``STATE``; a caller that finds another caller reading sleeps on
``STATE``, which that one notifies (and again when it lets the pump go). A caller tries the
pump with ``STATE`` held, and whoever lets it go notifies ``STATE`` after: a caller cannot go
to sleep just after the pump came free, with nobody left reading.

Nothing polls. Whatever else can end a wait posts a ``WAKE`` message to the result queue, so
that a reader blocked on it looks again: a task ended (or a stream cancelled) by a thread
that does not hold the pump (``_wake``), and ``shutdown()`` (the collector ends once the pool
is closing and owes nothing). Dead workers are noticed by the watcher thread, blocked on the
workers' sentinels and a wake-up pipe (``_poke``: a worker was started, or the pool stopped);
it posts ``(DIED, wid)`` behind everything the dead worker sent, so whoever reads the queue
handles its death after its last values (Note [Task protocol] in ``tasks/pool.py``), at
once: a SIGKILLed worker was once noticed 1 to 8 s late under load (issue 12).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import queue
import threading
import time
from typing import Any, Callable

from ..processes.forkcheck import fork_safe
from . import worker as W
from .refs import STATE

__all__ = ["Pump"]

log = logging.getLogger("torch_mp_ext.tasks")

_PUT_SLICE_S = 0.5  # the watcher's put on a full result queue re-checks that the pool runs
_GRACE_S = 0.01  # the collector leaves the pump to callers this long after the last waited


class Pump:
    """Mixin of TaskPool: the collector and watcher threads and ``_await`` (attributes and
    ``_handle``/``_dispatch``/``_detach_workers``/``_join_workers`` come from TaskPool)."""

    _results: Any
    _workers: dict
    _tasks: dict
    _closing: bool
    _stopped: bool
    _handle: Callable[[list], None]  # TaskState's
    _dispatch: Callable[[], None]
    _detach_workers: Callable[[], list]  # TaskPool's
    _join_workers: Callable[[list], None]
    _start_owed: Callable[[], None]

    def _init_pump(self) -> None:
        self._pump = threading.Lock()
        self._pumper: int | None = None  # the thread holding the pump
        self._turn = threading.Condition(threading.Lock())  # guards the three below
        self._waiters = 0  # callers in _await
        self._waited_until = 0.0  # the collector leaves the pump alone until then
        self._collector_reading = False  # the collector is blocked on the result queue
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None

    def _start_threads(self) -> None:
        # Fork-safe (Note [Fork after threads]): a fork child never touches the pool's state.
        self._watcher = fork_safe(threading.Thread(target=self._watch, name="TaskPool-watcher",
                                                   daemon=True))
        self._watcher.start()
        self._thread = fork_safe(threading.Thread(target=self._collect,
                                                  name="TaskPool-collector", daemon=True))
        self._thread.start()

    # -- waking a blocked reader -----------------------------------------------------------
    def _wake(self) -> None:
        """Makes whoever is blocked on the result queue look again (STATE held or not); a
        no-op in the thread that reads it (it looks again anyway)."""
        if self._pumper != threading.get_ident():
            self._wake_collector()

    def _poke(self) -> None:
        """Makes the watcher look at the workers again (one was started, or the pool stops)."""
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass  # the pipe is full of pokes: the watcher wakes anyway
        except OSError:
            log.debug("the TaskPool watcher's pipe is closed: the pool stopped", exc_info=True)

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._wake_r = self._wake_w = -1

    # -- the threads -----------------------------------------------------------------------
    def _watch(self) -> None:
        """Posts ``(DIED, wid)`` for each worker whose process ended (Note [Who reads the
        result queue])."""
        reported: set[int] = set()
        while True:
            with STATE:
                if self._stopped:
                    return
                sentinels = {w.process.sentinel: w.wid for w in self._workers.values()
                             if w.wid not in reported}
            ready = multiprocessing.connection.wait([*sentinels, self._wake_r])
            for fd in ready:
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                reported.add(sentinels[fd])
                while True:
                    try:
                        self._results.put((W.DIED, sentinels[fd]), timeout=_PUT_SLICE_S)
                        break
                    except queue.Full:
                        if self._stopped:
                            return
                    except ValueError:  # closed: the pool stopped
                        return

    def _collect(self) -> None:
        me = threading.get_ident()
        while True:
            with self._turn:  # Note [Who reads the result queue]: callers first
                while self._waiters or time.monotonic() < self._waited_until:
                    self._turn.wait(None if self._waiters
                                    else self._waited_until - time.monotonic())
            with self._pump:
                self._pumper = me
                try:
                    with STATE:
                        if self._closing and not self._tasks:
                            break
                    with self._turn:
                        self._collector_reading = not self._waiters
                    if self._collector_reading:
                        self._pump_once(None)
                finally:
                    self._pumper = None
                    with self._turn:
                        self._collector_reading = False
            with STATE:  # a caller may wait for the pump to be free
                STATE.notify_all()
        with STATE:
            workers = self._detach_workers()
        self._join_workers(workers)  # STATE released: other pools go on meanwhile

    def _stop_watcher(self) -> None:
        """After ``_detach_workers`` (``_stopped`` is set): ends the watcher, closes its pipe."""
        self._poke()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        self._close_pipe()

    def _pump_once(self, timeout: float | None) -> None:
        """Reads and handles what the workers sent (the pump lock held, STATE not)."""
        try:
            msgs = self._results.get_many(256, timeout=timeout)
        except (queue.Empty, ValueError):  # nothing, or closed: the pool stopped
            return
        with STATE:
            self._handle(msgs)
            self._dispatch()
            STATE.notify_all()
        self._start_owed()  # dead workers' replacements, STATE released (issue 26)

    def _await(self, ready: Callable[[], Any], deadline: float | None) -> None:
        """Returns once ``ready()`` (checked with STATE held) or ``deadline`` passed,
        reading the result queue in this thread if no other caller does (called without
        STATE; Note [Who reads the result queue])."""
        with self._turn:
            self._waiters += 1
            if self._collector_reading:
                self._wake_collector()
        try:
            self._await_turn(ready, deadline)
        finally:
            with self._turn:
                self._waiters -= 1
                self._waited_until = time.monotonic() + _GRACE_S
                self._turn.notify_all()

    def _wake_collector(self) -> None:
        try:
            self._results.put((W.WAKE, -1), block=False)
        except queue.Full:
            pass  # a full queue wakes its reader by itself
        except ValueError:
            pass  # closed: the pool stopped, nobody reads it any more

    def _await_turn(self, ready: Callable[[], Any], deadline: float | None) -> None:
        me = threading.get_ident()
        while True:
            with STATE:
                if ready():
                    return
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return
                # Tried with STATE held: whoever lets the pump go notifies STATE after (below,
                # and in _collect), so this wait cannot miss the pump coming free.
                if self._stopped or not self._pump.acquire(blocking=False):
                    STATE.wait(remaining)  # also notified for each message its holder handles
                    continue
            self._pumper = me
            try:
                self._pump_once(remaining)
            finally:
                self._pumper = None
                self._pump.release()
                with STATE:  # another caller may wait for the pump to be free
                    STATE.notify_all()
