"""Task pools whose tasks return many values: Ray-style generator tasks, streamed as produced.

::

    caller process                                                    worker processes
    ─────────────────────────────────────────────                     ─────────────────
    pool.submit(fn, *args, num_returns=...)
      │ pickled here (Refs in args: once ready)     own task queue
      └─▶ dispatch to an idle worker ─────────────────────────────▶  fn(*args): each value
                                                                      yielded is pickled at
    collector thread ◀── one result queue ◀── (ITEM tid i wire) ───  once: tensors/arrays
      │ fills Refs / RefGenerator buffers,                            → arena blocks, the
      │ handles (DIED wid) from the watcher         ◀── (DONE ...) ─  message only handles
      │ thread (it waits on the sentinels),
      │ dispatches the next task                    ──▶ (CREDIT / CANCEL) between yields
      ▼
    Ref.get(): unpickles, zero-copy views of the worker's blocks (never a copy of the data)

Note [Task protocol]
Every worker has its own task queue (the pool decides which worker runs what, so it knows
whose refs to fail when a worker dies) and all share one result queue; both are
``torch_mp_ext.Queue`` rings, so a worker SIGKILLed mid-``put`` leaves them usable. The
messages are in ``tasks/worker.py``. A worker runs one task at a time and gets the next when
its DONE arrives. Values arrive in order per worker, and a dead worker's messages are all
read before its death is handled (its DIED comes after them: Note [Who reads the result
queue] in ``tasks/pump.py``), so its refs get every value it produced before the error.
Back-pressure (``max_buffered``): a streaming worker that is ``max_buffered`` values ahead of
the consumer sends WAIT and blocks on its queue; the consumer's ``next()`` sends a CREDIT
(how many it consumed) once it has caught up. Cancellation is a CANCEL the worker reads after
each ``yield``; it closes the generator (``GeneratorExit`` at the ``yield``) and sends DONE.

Note [Exit]
A pool still running when the interpreter exits (nobody called ``shutdown()``) is terminated
by an exit finalizer that runs before ``multiprocessing``'s: refs still owed get
``PoolClosedError``, workers are killed (as ``multiprocessing.Pool`` terminates its daemonic
workers), and the collector thread ends. Otherwise the interpreter would freeze that daemon
thread wherever it was, possibly holding ``STATE``, and a RefGenerator collected later
would wait for the lock for ever.

Note [Counts that differ from num_returns]
A fixed ``num_returns=k`` generator has its first k-1 values sent as yielded; the k-th is
pickled at once but sent when the generator has finished, because only then is it known that
it does not yield more. Too many: the generator is closed at value k+1 and ref k holds a
``ReturnCountError`` (Ray only logs this, ray-project/ray#28689). Too few: the missing refs
hold one, saying how many were expected and produced. An exception after the last value goes
into ref k as well. ``"dynamic"`` and ``"streaming"`` have no count to match.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from multiprocessing import util
from typing import Any, Callable

from ..errors import PoolClosedError, TaskCancelledError
from ..processes import exits as _exits
from ..processes.context import default_context
from ..processes.spawn import launch_plan
from ..queues.ring_queue import Queue
from . import worker as W
from .pump import Pump
from .refs import STATE, Entry, Ref, RefGenerator
from .state import (
    Task,
    TaskState,
    Worker,
    error_value,
    next_tid,
    parse_num_returns,
    pending_refs,
)
from .streams import Stream
from .values import Value, encode

__all__ = ["TaskPool"]

log = logging.getLogger("torch_mp_ext.tasks")

_TASK_QUEUE_BYTES = 1 << 20
_STOP_WAIT_S = 5.0
_live: weakref.WeakSet = weakref.WeakSet()


def _terminate_all() -> None:
    """At exit, before multiprocessing's own exit handler: stop pools nobody shut down."""
    for pool in list(_live):
        pool._terminate()


# Priority 20: before multiprocessing terminates daemonic children (Note [Exit] below).
util.Finalize(None, _terminate_all, exitpriority=20)
util.register_after_fork(_live, lambda _: _live.clear())


class TaskPool(TaskState, Pump):
    """A pool of worker processes running tasks that return one value, k values, or a stream.

    Args:
        processes: number of workers (default ``os.cpu_count()``).
        start_method: ``"forkserver"`` (default: torch_mp_ext's fast server, see
            docs/processes.md), ``"spawn"`` or ``"fork"``.
        initializer: called as ``initializer(*initargs)`` in each worker when it starts;
            if it raises, the pool stops and its tasks fail with ``PoolClosedError``.
        initargs: arguments for ``initializer``.

    ``fn`` and its arguments must pickle (lambdas and local functions are pickled by value,
    Note [By-value fallback] in ``sharing/byvalue.py``). Used as a context manager, the pool
    is shut down (waiting for its tasks) on exit.

    Example:
        ```python
        import torch_mp_ext as mp

        def squares(n):
            for i in range(n):
                yield i * i

        if __name__ == "__main__":
            with mp.TaskPool(2, start_method="fork") as pool:
                stream = pool.submit(squares, 4, num_returns="streaming")
                assert [ref.get(timeout=60) for ref in stream] == [0, 1, 4, 9]
                assert pool.submit(pow, 2, 10).get(timeout=60) == 1024
        ```
    """

    def __init__(self, processes: int | None = None, *, start_method: str | None = None,
                 initializer: Callable[..., Any] | None = None, initargs: tuple = ()) -> None:
        count = (os.cpu_count() or 1) if processes is None else processes
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"processes must be a positive integer, got {processes!r}")
        method = start_method or "forkserver"
        self._ctx: Any = default_context.get_context(method)  # ValueError for unknown names
        self._init = (initializer, tuple(initargs))
        self._results = Queue()
        self._workers: dict[int, Worker] = {}
        self._idle: deque = deque()
        self._ready: deque = deque()
        self._tasks: dict[int, Task] = {}
        self._closing = False
        self._broken: str | None = None
        self._wids = itertools.count()
        self._oom_before = _exits.oom_kill_counts()
        self._fault_dir = tempfile.mkdtemp(prefix="torch_mp_ext-pool-")  # crash stacks
        weakref.finalize(self, shutil.rmtree, self._fault_dir, True)
        self._stopped = False
        self._owed_workers = 0  # replacements of dead workers not started yet
        self._init_pump()
        try:
            for _ in range(count):
                self._start_worker()
        except BaseException:
            self._stop_workers()
            raise
        self._start_threads()
        _live.add(self)

    # -- public API ------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], /, *args: Any, num_returns: int | str = 1,
               max_retries: int = 0, max_buffered: int | None = None,
               **kwargs: Any) -> Ref | list[Ref] | RefGenerator:
        """Runs ``fn(*args, **kwargs)`` in a worker.

        Args:
            fn: a picklable callable; a function or a generator function.
            *args: its arguments. A :class:`Ref` argument is passed as its value, read in
                the worker from shared memory; the task starts once such refs are ready.
            num_returns: ``1``: one :class:`Ref`. ``k``: a list of k refs, filled as the
                generator yields (or from a returned list/tuple of k values).
                ``"dynamic"``: one Ref whose value, once the task ends, is a
                :class:`RefGenerator` of all the values. ``"streaming"``: a RefGenerator at
                once, yielding each ref as soon as the worker yields the value.
            max_retries: times to re-run the task when its worker dies (a generator is
                re-run from the start, values already delivered are skipped: it must be
                deterministic). The task's own exceptions are never retried.
            max_buffered: ``"streaming"`` only: the worker pauses while this many values
                are yielded but not yet taken by the consumer (default: no limit).
            **kwargs: keyword arguments of ``fn``.

        Raises:
            ValueError: invalid ``num_returns``, ``max_retries`` or ``max_buffered``.
            PoolClosedError: the pool was shut down.
            Exception: whatever pickling ``fn`` or its arguments raised.
        """
        mode, k = parse_num_returns(num_returns)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be a non-negative integer, got {max_retries!r}")
        if max_buffered is not None and (mode != W.MODE_STREAMING or isinstance(
                max_buffered, bool) or not isinstance(max_buffered, int) or max_buffered < 1):
            raise ValueError(f"max_buffered must be None or a positive integer, and only with "
                             f"num_returns='streaming'; got {max_buffered!r} with "
                             f"num_returns={num_returns!r}")
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        task = Task(self, W.label(fn), mode, k, max_buffered, max_retries)
        call = (fn, args, kwargs)
        with STATE:
            waiting = pending_refs(args, kwargs)
        if not waiting:
            task.payload = Value.from_wire(encode(call))  # pickling errors raise here
        with STATE:
            if self._closing or self._broken:
                if task.payload is not None:
                    task.payload = None
                raise PoolClosedError(self._broken or "submit() on a TaskPool that was shut "
                                      "down: submit before shutdown(), or use a new pool")
            oids = range(k) if mode in (W.MODE_ONE, W.MODE_FIXED) else range(1)
            if mode == W.MODE_STREAMING:
                task.stream = Stream(task)
            else:
                task.entries = [Entry((task.tid, i, task.label), None, self) for i in oids]
            self._tasks[task.tid] = task
            waiting = [e for e in waiting if e.value is None]
            if waiting or task.payload is None:
                task.call = call
                task.deps = len(waiting)
                for entry in waiting:
                    entry.dependents = (entry.dependents or []) + [task]
                if not waiting:
                    self._make_ready(task)
            else:
                self._ready.append(task)
            self._dispatch()
        if mode == W.MODE_STREAMING:
            return RefGenerator(_stream=task.stream)
        refs = [Ref(e) for e in task.entries]
        return refs if mode == W.MODE_FIXED else refs[0]

    def put(self, obj: Any) -> Ref:
        """A :class:`Ref` to ``obj``, stored as task values are (Ray's ``ray.put``): pass it
        to several tasks and its tensors and arrays are shared, never copied per task."""
        return Ref(Entry((next_tid(), 0, "put"), Value.from_wire(encode(obj))))

    def shutdown(self, wait: bool = True, cancel_pending: bool = False) -> None:
        """Stops the pool once its tasks have ended; no task may be submitted any more.

        Args:
            wait: block until every task has ended and the workers have exited.
            cancel_pending: fail the tasks that have not started with
                ``TaskCancelledError`` instead of running them. Running tasks finish
                (a streaming one whose consumer stopped reading: call ``cancel()``).

        Values already produced stay readable after the pool is gone.
        """
        with STATE:
            self._closing = True
            for task in list(self._tasks.values()):
                if cancel_pending and task.wid is None:
                    self._end(task, error_value(TaskCancelledError(
                        f"task {task.tid} ({task.label}) was cancelled by "
                        "shutdown(cancel_pending=True) before it started")), cancelled=True)
                elif task.max_buffered:  # nobody may consume any more: let it run out
                    task.max_buffered = None
                    if task.wid is not None:
                        self._workers[task.wid].tasks.put((W.CREDIT, task.tid, 1 << 60))
            STATE.notify_all()
            self._wake()  # the collector ends once nothing is owed
        thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def _terminate(self) -> None:
        """Note [Exit]: fails every task still owed, kills the workers, stops the collector.

        A pool not shut down when the interpreter exits is terminated like
        ``multiprocessing.Pool``'s daemonic workers are: running tasks are not waited for
        (``with TaskPool() as pool`` waits for them). Done before the interpreter freezes
        the collector thread, which could otherwise hold ``STATE`` for ever.
        """
        with STATE:
            if self._stopped:
                return
            self._closing = True
            for task in list(self._tasks.values()):
                self._end(task, error_value(PoolClosedError(
                    f"the interpreter exited while task {task.tid} ({task.label}) ran, and its "
                    "TaskPool was not shut down: use `with TaskPool() as pool:` or call "
                    "pool.shutdown() to wait for tasks")))
            workers = list(self._workers.values())
        for w in workers:
            try:
                w.process.kill()
            except (OSError, ValueError):
                log.debug("worker %s was already gone", w.pid)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(_STOP_WAIT_S)

    def __enter__(self) -> TaskPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown(wait=True)

    def __repr__(self) -> str:
        state = "closing" if self._closing else "running"
        return (f"<TaskPool {state}, {len(self._workers)} workers, "
                f"{len(self._tasks)} tasks at {id(self):#x}>")

    @property
    def pids(self) -> list[int]:
        """The workers' pids (a dead worker's replacement has a new one)."""
        with STATE:
            return [w.pid for w in self._workers.values()]

    # -- workers ---------------------------------------------------------------------------
    def _start_worker(self) -> None:
        """Starts a worker while the pool is created (not shared yet: STATE not needed)."""
        self._add_worker(self._launch())

    def _launch(self) -> Worker:
        """A started worker, not yet in the pool. Never with STATE held: a spawn or
        forkserver start can take seconds, and STATE is every pool's lock (issue 26)."""
        wid = next(self._wids)
        tasks = Queue(max_bytes=_TASK_QUEUE_BYTES)
        # Note [Children die with their parent]: judged in the thread that starts the worker
        # (PR_SET_PDEATHSIG would fire when a short-lived creating thread ends).
        parent = launch_plan(self._ctx.get_start_method())[2]
        process = self._ctx.Process(
            target=W.main, args=(wid, tasks, self._results, *self._init),
            kwargs={"parent": parent, "fault_dir": self._fault_dir},
            name=f"TaskPool-worker-{wid}", daemon=True)
        try:
            process.start()
        except BaseException:
            tasks.close()
            raise
        return Worker(wid, process, tasks)

    def _add_worker(self, worker: Worker) -> None:
        self._workers[worker.wid] = worker
        self._idle.append(worker.wid)
        self._poke()  # the watcher waits on its sentinel too

    def _start_owed(self) -> None:
        """Starts the replacements of dead workers that ``_on_death`` counted, with the pump
        held and STATE not (see ``_launch``)."""
        while True:
            with STATE:
                if not self._owed_workers:
                    return
                if self._stopped or self._broken or (self._closing and not self._tasks):
                    self._owed_workers = 0
                    return
                self._owed_workers -= 1
            try:
                worker = self._launch()
            except Exception as e:  # noqa: BLE001 (whatever the start raised: reported below)
                self._start_failed(e)
                return
            with STATE:
                if not self._stopped:
                    self._add_worker(worker)
                    self._dispatch()
                    STATE.notify_all()
                    continue
            worker.process.kill()  # the pool stopped while it started
            worker.process.join()
            worker.process.close()
            worker.tasks.close()

    def _start_failed(self, error: Exception) -> None:
        cause = (f"a TaskPool could not start a worker to replace a dead one "
                 f"({type(error).__name__}: {error})")
        with STATE:
            if self._workers:
                log.warning("%s; it goes on with %d workers", cause, len(self._workers))
                return
            self._broken = f"{cause}, and has none left; create a new pool"
            for task in list(self._tasks.values()):
                self._end(task, error_value(PoolClosedError(self._broken)))
            STATE.notify_all()

    def _stop_workers(self) -> None:
        """Takes the workers out of the pool (STATE held) and stops them (STATE not)."""
        self._join_workers(self._detach_workers())

    def _detach_workers(self) -> list[Worker]:
        """Call with STATE held: the pool has no worker any more; the caller joins them
        with :meth:`_join_workers` after releasing STATE (a join takes up to
        ``_STOP_WAIT_S``, and STATE is every pool's lock: issue 26)."""
        self._stopped = True
        workers = list(self._workers.values())
        self._workers.clear()
        return workers

    def _join_workers(self, workers: list[Worker]) -> None:
        """Asks ``workers`` to stop, joins them (killing those still alive after
        ``_STOP_WAIT_S``) and closes the pool's queues. Never with STATE held."""
        self._stop_watcher()  # first: it waits on the sentinels of processes closed below
        for w in workers:
            try:
                w.tasks.put((W.STOP,), timeout=1.0)
            except Exception:  # noqa: BLE001 (full or closed: it is killed below)
                log.debug("could not ask worker %s to stop; it will be killed", w.pid)
        deadline = time.monotonic() + _STOP_WAIT_S
        for w in workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.exitcode is None:
                w.process.kill()
                w.process.join()
            w.process.close()
            w.tasks.close()
        self._results.close()
