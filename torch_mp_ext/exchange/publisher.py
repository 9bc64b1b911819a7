"""Wakes the readers of a StateDictChannel when its publisher dies (Note [Publisher death]).

The channel records its publisher's holder key; a reader that is about to wait starts one
:class:`PublisherWatch` per channel object and process. Its thread blocks in ``poll`` on the
publisher's pidfd and an eventfd (to stop it), costing no CPU; when the publisher exits it
asks the channel to judge (``check_publisher``: the one liveness rule of the core, so a
recycled pid never counts as the dead publisher), which closes the channel as "publisher
died" and wakes every waiter in every process. A learner that closed the channel first
makes the judgement a no-op.
"""

from __future__ import annotations

import os
import select
import threading
from typing import Any

__all__ = ["PublisherWatch"]

_PID_MASK = 0x3FFFFFFF  # Note [Process identity]: the pid is bits 32..61 of a key
_STOP_TIMEOUT = 5.0


class PublisherWatch:
    """One thread watching the publisher of one channel for this process.

    Args:
        channel: the ``_C.LatestChannel``.
        label: names the channel in the thread's name.
    """

    def __init__(self, channel: Any, label: str) -> None:
        self._channel = channel
        self._label = label
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._key = 0
        self._stop = -1  # an eventfd, made with the first thread
        self._thread: threading.Thread | None = None

    def ensure(self) -> None:
        """Watches the channel's current publisher, unless it is this process, none is
        recorded yet, or the channel is closed already."""
        key = self._channel.publisher
        if key == 0 or (key == self._key and self._pid == os.getpid()) or self._channel.closed:
            return
        pid = (key >> 32) & _PID_MASK
        if pid == os.getpid():
            return  # this process publishes
        with self._lock:
            if self._pid != os.getpid():  # a forked copy: the thread stayed in the parent
                if self._stop >= 0:
                    os.close(self._stop)  # our copy of the parent's eventfd
                self._reset()
            if self._thread is not None:  # a new publisher took over: watch that one
                self._stop_thread()
            if self._stop < 0:
                self._stop = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            self._key = key
            self._thread = threading.Thread(target=self._run, args=(pid, self._stop),
                                            daemon=True,
                                            name=f"torch_mp_ext publisher watch {self._label}")
            self._thread.start()

    def _run(self, pid: int, stop: int) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            pidfd = -1  # gone already: judge at once
        except OSError:
            return  # no pidfd here (old kernel, seccomp): waits end by their own timeouts
        try:
            if pidfd >= 0:
                poller = select.poll()
                poller.register(pidfd, select.POLLIN)
                poller.register(stop, select.POLLIN)
                if any(fd == stop for fd, _ in poller.poll()):
                    return
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        self._channel.check_publisher()

    def _stop_thread(self) -> None:
        os.eventfd_write(self._stop, 1)
        if self._thread is not None:
            self._thread.join(_STOP_TIMEOUT)
        os.eventfd_read(self._stop)  # drained for the next thread
        self._thread = None

    def close(self) -> None:
        """Stops the thread (if any) and closes its eventfd."""
        with self._lock:
            if self._pid != os.getpid():
                if self._stop >= 0:
                    os.close(self._stop)
                self._reset()
                return
            if self._thread is not None:
                self._stop_thread()
            if self._stop >= 0:
                os.close(self._stop)
                self._stop = -1
