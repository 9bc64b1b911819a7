"""What a spawn or forkserver child's start payload carried, given back if it never opened it.

Note [Unopened payloads]
A spawn or forkserver child receives its Process object as a pickle (the *payload*), and every
block handle or queue in it carries a counted reference or an in-flight holder (Note [Tickets]
in ``csrc/shm/layout.h``, Note [Ring holders] in ``csrc/queue/ring.h``) that only the child
can redeem. A child that dies before unpickling it (SIGKILLed while it imports torch or the
main module, a main module that fails to import, a failed exec) redeems none of them, and
nothing else ever would: a DataLoader worker killed during its start kept the result queue's
and its index queue's rings, and every tensor of its dataset, until the parent exited.

So the parent keeps the payload until the child says it opened it:
  - the payload's Process state begins with a marker (``StrategyCarrier.__getstate__``), an
    fd passed to the child whose rebuild writes one byte to a pipe the parent reads. The state
    is unpickled in order, so the byte is written before any reference is redeemed;
  - the parent's ``Popen.poll()`` (every ``is_alive()``, ``join()``, ``exitcode``) looks at
    the pipe: a byte means the child took over; no byte and the child gone means it never
    opened the payload, and the parent gives every reference in it back, walking it with the
    unpickler that drops dropped queue frames (Note [Releasing dropped frames] in
    ``sharing/pickling.py``; by-value calls are walked too).
The byte is written after the child imported the modules the state names (the marker lists
them: the target's, and its arguments' classes'), so that a slow import (a dataset's module
under load) happens before it, not between it and the references taken over.
A child that dies after the byte, half way through unpickling, keeps what it redeemed
counted under its own key (reclaimed as a dead holder's) and leaks only the references it had
not reached yet: giving those back could spend another handle's ticket, so they stay, as
after any crash.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
from multiprocessing import reduction
from typing import Any, Optional

from ..sharing import pickling

__all__ = ["GuardedPopen", "PayloadGuard", "opened_marker"]

log = logging.getLogger(__name__)

_OPENED = b"S"


def _payload_opened(dupfd: Any, modules: tuple = ()) -> None:
    """Runs in the child when its state's first key is unpickled: imports the modules the
    rest of the state names (so that the window between this byte and the last reference
    taken over holds no import), then tells the parent."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 (the real unpickling raises it, with its context)
            break
    fd = dupfd.detach()
    try:
        os.write(fd, _OPENED)
    finally:
        os.close(fd)


class _Marker:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._dup: Any = None
        self.modules: tuple = ()

    def __reduce__(self) -> tuple:
        # Once per payload: a by-value retry pickles the state again, and a second DupFd
        # would pass the fd to the child twice (spawn refuses duplicate fds_to_keep).
        if self._dup is None:
            self._dup = reduction.DupFd(self.fd)
        return (_payload_opened, (self._dup, self.modules))


class PayloadGuard:
    """The payload a child was sent, kept until the child opens it or dies (Note [Unopened
    payloads])."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self._payload: Optional[memoryview] = None
        self._inner: list[bytes] = []
        self._marker = _Marker(self._w)

    def marker(self) -> _Marker:
        """The object the payload's Process state starts with."""
        return self._marker

    def add_inner(self, data: bytes) -> None:
        """A pickle carried inside the payload as bytes (a by-value call)."""
        self._inner.append(data)

    def sent(self, fp: io.BytesIO, start: int) -> None:
        """The payload, from ``start`` in ``fp``, is with the child (or failed to go)."""
        self._payload = fp.getbuffer()[start:]
        self.close_write_end()

    def close_write_end(self) -> None:
        if self._w is not None:
            os.close(self._w)
            self._w = None

    def discard(self) -> None:
        """The payload could not be made: nothing went, nothing to judge."""
        self.close_write_end()
        if self._r is not None:
            os.close(self._r)
            self._r = None
        self._inner = []

    def settle(self, dead: bool) -> None:
        """Forgets the payload once the child opened it; gives it back if the child died
        without."""
        if self._r is None:
            return
        try:
            opened = os.read(self._r, 1) == _OPENED
        except BlockingIOError:
            opened = False
        if not (opened or dead):
            return
        os.close(self._r)
        self._r = None
        self.close_write_end()
        payload, inner = self._payload, self._inner
        self._payload, self._inner = None, []
        if payload is None:  # the launch failed before the payload went
            return
        if not opened:
            log.debug("a child died before opening its start payload: giving its references "
                      "back (Note [Unopened payloads])")
            for data in (payload, *inner):
                pickling.release_pickle(data)
        payload.release()


class GuardedPopen:
    """Mixin for a Popen whose ``_launch`` sends a payload through a :class:`PayloadGuard`
    (``self._tmx_payload_guard``): settles it whenever the child is polled."""

    _tmx_payload_guard: Optional[PayloadGuard] = None

    def poll(self, flag: int = os.WNOHANG) -> Optional[int]:
        code: Optional[int] = super().poll(flag)  # type: ignore[misc]
        guard = self._tmx_payload_guard
        if guard is not None:
            guard.settle(dead=code is not None)
            if code is not None:
                self._tmx_payload_guard = None
        return code

    def _tmx_launch_guarded(self, fp: io.BytesIO, dump: Any, launch: Any) -> None:
        """``dump()`` pickles the payload into ``fp`` (prep data first, then the Process),
        ``launch()`` starts the child and sends it."""
        guard = self._tmx_payload_guard = PayloadGuard()
        try:
            start = dump()
        except BaseException:
            guard.discard()
            self._tmx_payload_guard = None
            raise
        try:
            launch()
        finally:
            guard.sent(fp, start)
            if getattr(self, "pid", None) is None:  # no child: nobody will open it
                guard.settle(dead=True)
                self._tmx_payload_guard = None


def opened_marker(popen: Any, state: dict) -> Optional[_Marker]:
    """The marker for the payload ``popen`` is pickling, or None (fork, or another Popen);
    it names the modules of what ``state`` holds (one level into ``_args`` and
    ``_kwargs``), for the child to import before it signals."""
    guard = getattr(popen, "_tmx_payload_guard", None)
    if guard is None:
        return None
    marker = guard.marker()
    objects = [*state.values(), *state.get("_args", ()), *state.get("_kwargs", {}).values()]
    names = {getattr(x, "__module__", None) if callable(x) else type(x).__module__
             for x in objects}
    marker.modules = tuple(sorted(n for n in names if isinstance(n, str)
                                  and n not in ("__main__", "builtins")))
    return marker
