"""Which queue objects hold which rings, in this process: letting go, at exit and across fork.

The protocol is Note [Queue lifetime] in ``ring_queue.py``; this module keeps this process's
side of it: a weak set of the rings its queue objects hold, the hooks that count fork
children's copies (Note [Fork children hold before they run] in ``csrc/python/bind_queue.cpp``)
and let go of every ring at exit, and the deferral of let-gos during a garbage collection.
"""

from __future__ import annotations

import gc
import multiprocessing.util
import os
import weakref

from .. import _C
from ..sharing.pickling import release_frame

__all__ = ["hold", "let_go", "has_exited"]

_held: weakref.WeakSet[_C.Ring] = weakref.WeakSet()


def hold(ring: _C.Ring) -> None:
    """``ring`` is held by a queue object of this process until :func:`let_go`."""
    _held.add(ring)


def has_exited() -> bool:
    """True once the exit hook let go of every ring (Note [Puts after exit])."""
    return _exited


def let_go(ring: _C.Ring) -> None:
    """One queue object of this process stops holding ``ring``; the last holder anywhere
    drains it (Note [Queue lifetime] in ``ring_queue.py``)."""
    if _collecting or _forking:  # Note [Queues freed by the cycle collector]
        _freed_while_collecting.append(ring)
        return
    _held.discard(ring)
    if ring.detach():
        for tag, data in ring.drain():
            release_frame(tag, data)
    # The block reference goes now, not at interpreter exit: a process SIGTERMed in between
    # (Pool.terminate() during a worker's exit) would otherwise keep the ring alive.
    ring.release()


# Note [Queues freed by the cycle collector]
# A queue in a reference cycle is freed by the cycle collector, which calls weakref callbacks
# (our Finalize) before the __del__ methods of the other objects of the cycle. One of those
# may still use the queue: DataLoader's iterator puts its workers' shutdown sentinels in
# __del__. So a ring let go during a collection is kept until the collection ends (gc's "stop"
# callback), when every __del__ of that collection has run.
# A ring let go between the before-fork hook and the fork is kept the same way, until the
# fork is over (Note [Fork children hold before they run] in csrc/python/bind_queue.cpp): the
# child inherits it counted and lets go of its own copy then.
_collecting = False
_forking = False
_freed_while_collecting: list[_C.Ring] = []


def _flush_freed() -> None:
    while _freed_while_collecting and not (_collecting or _forking):
        let_go(_freed_while_collecting.pop())


def _on_gc(phase: str, info: dict) -> None:
    global _collecting
    if phase == "start":
        _collecting = True
        return
    _collecting = False
    _flush_freed()


gc.callbacks.append(_on_gc)


# Note [Puts after exit]
# The exit hook lets go of every ring before the process ends. In a multiprocessing child,
# ``Process._bootstrap`` runs it while the exception that ended ``run()`` is still alive; when
# that exception is then cleared, the objects its traceback held are freed, and their
# ``__del__`` may still put on a queue (DataLoader's iterator puts its workers' shutdown
# sentinels). The process is ending and its workers were terminated: such a put is dropped,
# as the standard library's would be (its feeder thread is never flushed after the exit
# hook), instead of raising into an "Exception ignored" report on stderr.
_exited = False


def _let_go_all() -> None:
    global _exited
    _exited = True
    for ring in list(_held):
        let_go(ring)


def _before_fork() -> None:
    """Note [Fork children hold before they run]: counts the child's holders now."""
    global _forking
    _forking = True
    for ring in list(_held):
        ring.count_fork_child()


def _after_fork_in_parent() -> None:
    global _forking
    for ring in list(_held):
        ring.fork_parent_done()
    _forking = False
    _flush_freed()


def _after_fork_in_child() -> None:
    global _forking
    for ring in list(_held):
        ring.attach_inherited()
    _forking = False
    _flush_freed()


def _register_exit_hook() -> None:
    # After user finalizers, before _memory drops this process's block references (-100).
    multiprocessing.util.Finalize(None, _let_go_all, exitpriority=-50)


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
_register_exit_hook()
multiprocessing.util.register_after_fork(_register_exit_hook, lambda _: _register_exit_hook())
