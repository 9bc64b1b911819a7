"""Telling the user when a fork copies a process that runs other threads.

Note [Fork after threads]
``fork()`` copies only the calling thread. Every lock another thread held at that instant
stays held in the child for ever: a malloc arena, an OpenMP/MKL pool's lock, a tokenizer's or
cv2's pool, gRPC's, a logging handler's. The child then hangs at random, usually in a
DataLoader worker, with nothing in the log (pytorch/pytorch#1355, #33296). Before our fork
path starts a child, :func:`check` counts the other threads, Python ones by name and native
ones (not started by Python: OpenMP, MKL, gRPC...) from ``/proc/self/task``, and the first
time there are any it warns (:class:`~torch_mp_ext.errors.ForkAfterThreadsWarning`, through
``warnings``, so it can be silenced or made an error), naming them and suggesting forkserver.

Not counted: torch_mp_ext's own helper threads, which are fork-safe by design (at-fork
handlers put their state right in the child): native ones are named ``tmx-*``
(``/proc/self/task/<tid>/comm``), Python ones are registered with :func:`fork_safe`. Nor are
the native threads already running when torch_mp_ext was imported: those are the pools that
``import numpy``/``import torch`` start (OpenBLAS starts cores - 1 threads at load, and shuts
them down around ``fork()`` with its own ``pthread_atfork`` handlers); counting them would
warn in every program, at every first fork, and say nothing. Pools started later (torch's
OpenMP intra-op threads at the first parallel op, a tokenizer's, gRPC's) are counted.
The check costs a directory listing per fork start until it has warned, then nothing.
"""

from __future__ import annotations

import collections
import os
import threading
import warnings
import weakref

from ..errors import ForkAfterThreadsWarning

__all__ = ["check", "fork_safe", "other_threads"]

NATIVE_PREFIX = "tmx-"  # csrc names its threads so (prctl PR_SET_NAME)

_fork_safe: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_warned = False


def _tids() -> frozenset[str]:
    try:
        return frozenset(os.listdir("/proc/self/task"))
    except OSError:  # not Linux
        return frozenset()


_at_import = _tids()  # the pools of import numpy / import torch: not counted


def _after_fork_in_child() -> None:
    global _at_import
    _at_import = _tids()  # the parent's tids mean nothing here


os.register_at_fork(after_in_child=_after_fork_in_child)


def fork_safe(thread: threading.Thread) -> threading.Thread:
    """Registers one of torch_mp_ext's Python threads as fork-safe; returns it."""
    _fork_safe.add(thread)
    return thread


def _comm(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as fh:
            return fh.read().strip()
    except OSError:  # the thread ended meanwhile
        return ""


def other_threads() -> tuple[list[str], list[str]]:
    """(names of the other Python threads, names of the native threads) that a fork from
    the calling thread would leave behind, ours excepted (Note [Fork after threads])."""
    me = threading.current_thread()
    python = [t for t in threading.enumerate() if t is not me and t.is_alive()]
    known = {t.native_id for t in threading.enumerate()}
    named = [t.name for t in python if t not in _fork_safe]
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:  # not Linux: Python threads only
        return named, []
    native = []
    for tid in tids:
        if int(tid) in known or tid in _at_import:
            continue
        comm = _comm(tid)
        if comm and not comm.startswith(NATIVE_PREFIX):
            native.append(comm)
    return named, native


def check() -> None:
    """Warns, once per process, when a fork now would leave other threads behind."""
    global _warned
    if _warned:
        return
    named, native = other_threads()
    if not named and not native:
        return
    parts = []
    if named:
        parts.append(f"{len(named)} Python thread(s) ({', '.join(repr(n) for n in named)})")
    if native:
        counts = collections.Counter(native)
        listing = ", ".join(f"{n!r} x{c}" if c > 1 else repr(n) for n, c in counts.items())
        parts.append(f"{len(native)} native thread(s) not started by Python ({listing}; "
                     "OpenMP/MKL pools such as torch's intra-op threads, tokenizers, cv2 or "
                     "gRPC show the process's name)")
    warnings.warn(
        f"starting a child with the 'fork' start method while this process (pid "
        f"{os.getpid()}) runs {' and '.join(parts)}: fork copies only the calling thread, so "
        "a lock one of them holds stays locked in the child, which then may hang at random "
        "(the classic DataLoader freeze). Use the 'forkserver' start method (fast in "
        "torch_mp_ext: torch is preloaded) or 'spawn', or fork before starting threads. "
        "This warning is shown once per process.",
        ForkAfterThreadsWarning, stacklevel=3)
    _warned = True  # after warn(): a filter that makes it an error raises at every fork
