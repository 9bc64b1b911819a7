"""The consumer's side of a pipeline: starting its processes, watching them, stopping them.

Note [Stopping a pipeline]
Iteration ending, ``close()``, ``with``, garbage collection, interpreter exit, a stage's
failure and Ctrl-C all end in :func:`shutdown` (Note [Stage process lifecycle] in
``pipeline/stage_process.py``): every process stops at its next item, what is left in the queues is
discarded with the block references it holds, and the processes are joined. A process still
busy after the grace period (a stage stuck in its own code) is terminated, then killed.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any, List, Optional, Tuple

import numpy as np

from ..errors import PipelineError
from ..processes import exits as _exits
from ..processes.worker_reports import fault_path, read_fault_file
from ..queues.ring_queue import Queue
from ..sharing.arena import zeros_array
from .links import POLL_S, Inlet, Outlet, Role, Stop, discard
from .stage_process import EXIT, FINISHED, NEW, REPORTED, STOPPING, Task, feed, run

__all__ = ["Group", "Running", "launch", "shutdown"]

log = logging.getLogger("torch_mp_ext.pipeline")

#: (kind, fn, name, processes, buffer_size) of the source, a stage or the consumer.
Group = Tuple[str, Any, str, int, int]


class Running:
    """A started pipeline's processes, queues and control block; what shutdown needs (it
    holds no reference to the :class:`Pipeline`, so the pipeline can be collected)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.processes: List[Tuple[Any, Role, int]] = []
        self.pids: Tuple[int, ...] = ()
        self.queues: List[Queue] = []
        self.signals: Optional[Tuple[Queue, Queue]] = None  # (events, exits)
        self.control: Any = None
        self.thread: Optional[threading.Thread] = None
        self.inlet: Optional[Inlet] = None
        self.oom_before = _exits.oom_kill_counts()
        self.fault_dir = tempfile.mkdtemp(prefix="torch_mp_ext-pipeline-")  # crash stacks
        weakref.finalize(self, shutil.rmtree, self.fault_dir, True)
        self.closed = False

    def check(self) -> None:
        """The consumer's idle check: raises for a stage process that died."""
        if self.closed:  # by close() from another thread
            raise Stop
        # A stage killed by a signal is the cause; others that exited since are its effects.
        # The cause died first, so a second look finds it if the first polled it just before
        # it died. Issue 12: the error named another stage's exit, without the SIGKILL, one
        # time in several.
        for _ in range(2):
            dead = [(process, role, slot, process.exitcode)
                    for process, role, slot in self.processes
                    if self.control[slot] != REPORTED and process.exitcode is not None]
            if not dead or any(code < 0 for *_, code in dead):
                break
        dead.sort(key=lambda d: d[3] >= 0)
        for process, role, slot, code in dead[:1]:
            fault = read_fault_file(fault_path(self.fault_dir, process.pid))
            reason, explanation = _exits.explain_exit(code, oom_before=self.oom_before,
                                                      fault_text=fault)
            if code == 0 or (self.control[slot] == NEW and code > 0):
                explanation = (
                    "It exited before the end of its stream. "
                    + ("It never started: its function or the pipeline's queues could not be "
                       "unpickled there (see its stderr; define stage functions at the top "
                       "level of a module)." if self.control[slot] == NEW else
                       "Did it call os._exit()?"))
            message = f"{role.describe(process.pid)} {_exits.summarize(reason, code)}"
            raise PipelineError(
                message + (f". {explanation}" if explanation else ""), stage=role.name,
                position=role.position, worker=role.worker, pid=process.pid, exit_code=code,
                signal_name=_exits.signal_name(-code) if code < 0 else None)

    def stopping(self) -> None:
        if self.control[0]:
            raise Stop


def shutdown(state: Running, grace: float) -> None:
    """Stops and joins everything (Note [Stopping a pipeline]); safe to call twice. Interrupted
    (a second Ctrl-C), it kills what is left before the interruption goes on."""
    if state.closed or os.getpid() != state.pid:  # a forked child's copy owns nothing
        return
    state.closed = True
    try:
        _stop(state, grace)
    except BaseException:
        for process, _, _ in state.processes:
            if process._popen is not None and process.exitcode is None:
                process.kill()
                process.join()
        for q in state.queues + list(state.signals or ()):
            q.close()
        raise


def _stop(state: Running, grace: float) -> None:
    control = state.control
    if control is not None:
        control[0] = STOPPING
    deadline = time.monotonic() + grace
    # Note [Stage process lifecycle]: each final status comes with a slot on `events`; the
    # slices only look again at processes that died without one.
    while control is not None and state.signals is not None and any(
            p.exitcode is None and control[slot] < FINISHED for p, _, slot in state.processes):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            state.signals[0].get(True, min(left, POLL_S))
        except queue.Empty:
            pass
    if state.thread is not None and state.thread.ident is not None:
        state.thread.join(max(deadline - time.monotonic(), 0.0))
        if state.thread.is_alive():
            log.warning("a pipeline's source iterator has not returned within %.1f s of the "
                        "shutdown; its thread stops at its next item", grace)
    discard(state.queues)
    if control is not None:
        control[0] = EXIT
        if state.signals is not None:  # a token for each process waiting for EXIT
            state.signals[1].put_many([0] * len(state.processes), timeout=grace)
    for process, role, _ in state.processes:
        process.join(max(deadline - time.monotonic(), 0.0) + 1.0)
        if process.exitcode is None:
            log.warning("%s did not stop within %.1f s; terminating it",
                        role.describe(process.pid), grace)
            process.terminate()
            process.join(1.0)
            if process.exitcode is None:
                process.kill()
                process.join()
        process.close()  # its sentinel fd
    for q in state.queues + list(state.signals or ()):
        q.close()  # the last holder drops what is left (Note [Queue lifetime])
    state.signals = None
    state.inlet = None
    state.control = None


def _explain_start_failure(exc: Exception, role: Role, method: str) -> None:
    """Adds what failed, and for pickling errors the fix, to a ``Process.start`` error."""
    note = f"while starting {role.describe(None)} with start method {method!r}"
    if method != "fork":
        note += (": under spawn and forkserver a stage is pickled, so define it (and its "
                 "arguments) at the top level of a module, or use start_method='fork'")
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]} ({note})",) + exc.args[1:]


def launch(state: Running, groups: List[Group], ordered: bool, ctx: Any, parent: tuple) -> None:
    """Creates the queues and control block, starts the processes and the feeder thread.

    Args:
        state: where everything started is recorded (for :func:`shutdown`, even on failure).
        groups: ``(kind, fn, name, processes, buffer_size)`` for the source, each stage and
            the consumer (kind ``"local"``: a source iterated by a thread of this process).
        ordered: keep order across per-item stages with several workers.
        ctx: the multiprocessing context whose ``Process`` starts stages.
        parent: how children watch this process (``processes.worker.die_with_parent``).
    """
    nprocs = sum(g[3] for g in groups if g[0] not in ("local", "consumer"))
    state.control = control = zeros_array(1 + nprocs, np.uint8)
    state.signals = signals = (Queue(), Queue())  # Note [Stage process lifecycle]
    # Note [Pipeline links]: for each link, each producer's (targets, end_copies) and
    # each consumer's (sources, ends).
    writers: List[List[tuple]] = []
    readers: List[List[tuple]] = []
    for (_, _, _, n_p, size), (_, _, _, n_c, _) in zip(groups, groups[1:]):
        lanes = n_p == n_c or ordered
        qs = [Queue(size) for _ in range(max(n_p, n_c) if lanes else 1)]
        state.queues += qs
        if n_p == n_c:
            writers.append([([q], 1) for q in qs])
            readers.append([([q], 1) for q in qs])
        elif n_p == 1:
            writers.append([(qs, 1 if lanes else n_c)])
            readers.append([([q], 1) for q in qs] if lanes else [(qs, 1)] * n_c)
        else:
            writers.append([([q], 1) for q in qs] if lanes else [(qs, 1)] * n_p)
            readers.append([(qs, 1 if lanes else n_p)])
    slot = 0
    for position, (kind, fn, name, count, _) in enumerate(groups[:-1]):
        if kind == "local":
            role = Role(name, 0, local=True)
            outlet = Outlet(writers[0][0][0], writers[0][0][1], state.stopping)
            state.thread = threading.Thread(target=feed, args=(fn, role, outlet),
                                            name="torch_mp_ext-pipeline-source",
                                            daemon=True)
            continue
        for worker in range(count):
            slot += 1
            role = Role(name, position, worker, count)
            index = (worker, count) if ordered or count == 1 else None
            task = Task(role, kind, fn, readers[position - 1][worker] if position else None,
                        writers[position][worker], control, slot, parent, signals, index,
                        state.fault_dir)
            process = ctx.Process(target=run, args=(task,), daemon=False,
                                  name=f"torch_mp_ext-pipeline-{position}-{worker}")
            try:
                process.start()
            except Exception as exc:
                _explain_start_failure(exc, role, ctx.get_start_method())
                raise
            state.processes.append((process, role, slot))
            state.pids += (process.pid,)
    state.inlet = Inlet(readers[-1][0][0], readers[-1][0][1], state.check)
    if state.thread is not None:
        state.thread.start()  # after every fork: a forked child copies no running thread
