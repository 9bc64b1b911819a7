"""What a DataLoader worker leaves behind when it dies or hangs, and the report made of it.

In the worker, :class:`WorkerStart` (run as torch's ``worker_init_fn``) points
``faulthandler`` at a file named after the worker's pid in a directory of the main process's
choosing. In the main process, :func:`explain_death` turns the worker's exit code, that file
and the OOM counters into torch's message plus the cause (:func:`.exits.explain_exit`), and
:func:`stop_hung` stops a worker that made no progress so that its stack is in the file.

Note [A DataLoader worker's crash stack]
torch's worker loop installs its own handlers for SIGSEGV, SIGBUS, SIGFPE and SIGTERM (they
print "ERROR: Unexpected segmentation fault encountered in worker." and die of the signal),
replacing whatever was there, so ``faulthandler`` must be enabled *after* them: in
``worker_init_fn``, which torch calls once its handlers are set. faulthandler's handler then
runs first, writes the Python stack of every thread, and hands the signal on to torch's.
A worker forked from a process where faulthandler is on (pytest turns it on) inherits it
enabled, and ``enable()`` then only changes the file: the worker disables it (which puts back
what was there before the parent enabled it), reinstalls torch's handlers, and enables it.

Note [Stopping a hung worker for its stack]
A worker stuck in a dataset's ``__getitem__`` (a dead NFS mount, a deadlock, an endless loop)
is stopped with SIGABRT. faulthandler's handler writes the stack of every thread while the
process is still stuck where it hung (it runs in the signal handler: no GIL, no cooperation
from the stuck code), then lets SIGABRT end it. The main process waits for the exit through
the process's sentinel, so when it reads the file the stack is complete; a process that does
not die of it within a few seconds (a SIGABRT handler of its own) is killed.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from typing import Any, Callable, TextIO

from .. import torch_internals as _ti
from . import exits

__all__ = ["WorkerStart", "enable_fault_file", "explain_death", "fault_path", "hang_report",
           "read_fault_file", "stop_hung"]

#: Seconds a hung worker gets to write its stack and die of SIGABRT before SIGKILL.
STOP_GRACE_S = 5.0

_fault_file: TextIO | None = None  # kept open for the worker's lifetime


def fault_path(directory: str, pid: int) -> str:
    """The file the worker with ``pid`` writes its crash stack to."""
    return os.path.join(directory, f"{pid}.faulthandler")


class WorkerStart:
    """The ``worker_init_fn`` of a torch_mp_ext DataLoader's workers: turns on
    ``faulthandler`` (Note [A DataLoader worker's crash stack]), then calls the user's.

    Args:
        fn: the loader's ``worker_init_fn`` (or None).
        directory: where the crash stack goes (:func:`fault_path`).
    """

    def __init__(self, fn: Callable[[int], Any] | None, directory: str) -> None:
        self.fn = fn
        self.directory = directory

    def __call__(self, worker_id: int) -> None:
        enable_fault_file(self.directory, torch_handlers=True)
        if self.fn is not None:
            self.fn(worker_id)


def enable_fault_file(directory: str, *, torch_handlers: bool = False) -> None:
    """Points this process's ``faulthandler`` at :func:`fault_path` (once per process).

    Args:
        directory: the main process's directory for its workers' stacks.
        torch_handlers: this is a DataLoader worker whose loop installed torch's fatal-signal
            handlers (Note [A DataLoader worker's crash stack]).
    """
    global _fault_file
    if _fault_file is not None:
        return
    try:
        _fault_file = open(fault_path(directory, os.getpid()), "w")  # noqa: SIM115
    except OSError:
        return  # no stack in the report then; the worker works as before
    if faulthandler.is_enabled():
        # Inherited through fork: enable() would only change the file, leaving whatever
        # handler came later in front. Take faulthandler off (this puts back what was there
        # before the parent enabled it), put torch's handlers back, enable it on top.
        faulthandler.disable()
        if torch_handlers:
            _ti.set_worker_signal_handlers()
    faulthandler.enable(file=_fault_file, all_threads=True)


def read_fault_file(path: str) -> str:
    """The stack a worker's faulthandler wrote (:func:`.exits.read_fault_file`); the file
    is removed."""
    text = exits.read_fault_file(path)
    try:
        os.unlink(path)
    except OSError:
        pass
    return text


def explain_death(pid: int | None, exit_code: int | None, path: str,
                  oom_before: dict[str, int] | None) -> tuple[str, str]:
    """torch's message for a dead worker, and why it died.

    Args:
        pid: the worker's pid.
        exit_code: its ``Process.exitcode`` (negative: the signal).
        path: its :func:`fault_path` (read, then removed).
        oom_before: :func:`.exits.oom_kill_counts` from when it started.

    Returns:
        ``(message, reason)``: torch's words first ("DataLoader worker (pid 12) is killed by
        signal: Killed."), then the cause (:func:`.exits.explain_exit`); ``reason`` as
        :class:`~torch_mp_ext.errors.ProcessFailure`'s.
    """
    fault = read_fault_file(path)
    code = -signal.SIGKILL if exit_code is None else exit_code
    if code >= 0:
        stack = f"\nStack of the crashed process (faulthandler):\n{fault}" if fault else ""
        return (f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {code}. "
                "Details are lost due to multiprocessing. Rerunning with num_workers=0 may "
                "give better error trace." + stack), "exit_code"
    reason, why = exits.explain_exit(code, oom_before=oom_before, fault_text=fault)
    head = f"DataLoader worker (pid {pid}) is killed by signal: {signal.strsignal(-code)}. "
    if -code == signal.SIGBUS:  # torch's own hint, kept for those who grep for it
        head += ("It is possible that dataloader's workers are out of shared memory. Please "
                 "try to raise your shared memory limit.")
    return f"{head}\n{why}" if why else head, reason


def stop_hung(process: Any, path: str) -> str:
    """Stops a hung worker and returns its Python stack (Note [Stopping a hung worker for
    its stack]); the process is joined when this returns."""
    try:
        os.kill(process.pid, signal.SIGABRT)
    except ProcessLookupError:
        pass
    process.join(STOP_GRACE_S)
    if process.exitcode is None:
        process.kill()
        process.join()
    lines = read_fault_file(path).splitlines()
    while lines and (lines[0].startswith("Fatal Python error") or not lines[0].strip()):
        lines.pop(0)  # faulthandler's header for the SIGABRT we sent
    return "\n".join(lines)


def hang_report(worker_id: int, pid: int | None, timeout: float, stack: str) -> str:
    """The sentences saying that a worker hung, with its stack."""
    where = (f"Its Python stack when it was stopped (faulthandler):\n{stack}" if stack
             else "Its stack could not be read (faulthandler wrote nothing).")
    return (f"DataLoader worker {worker_id} (pid {pid}) made no progress for {timeout} seconds "
            f"while it had samples to load; torch_mp_ext stopped it with SIGABRT. {where}")
