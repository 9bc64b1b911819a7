"""The bookkeeping behind :class:`~torch_mp_ext.TaskPool`: tasks, workers, and what each
worker message does to them (Note [Task protocol] in ``tasks/pool.py``). Everything here runs
with ``STATE`` held, in whichever thread read the message (Note [Who reads the result queue]
in ``tasks/pump.py``).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from typing import Any, Callable

from ..errors import PoolClosedError, WorkerDiedError
from ..processes import exits as _exits
from ..processes.worker_reports import fault_path, read_fault_file
from ..queues.ring_queue import Queue
from . import worker as W
from .refs import Entry, Ref, RefGenerator
from .streams import Stream
from .values import ERROR, Value, discard, encode, encode_error

__all__ = ["TaskState", "error_value", "next_tid", "parse_num_returns", "pending_refs"]

log = logging.getLogger("torch_mp_ext.tasks")
_TIDS = itertools.count(1)
next_tid = _TIDS.__next__


def error_value(exc: BaseException) -> Value:
    return Value.from_wire(encode(exc, ERROR))


class Task:
    """One submitted task, from submit until its worker says it ended."""

    __slots__ = (
        "call",
        "cancelled",
        "deps",
        "ended",
        "entries",
        "items",
        "k",
        "label",
        "max_buffered",
        "mode",
        "payload",
        "pool",
        "produced",
        "retries",
        "skip",
        "stream",
        "tid",
        "wid",
    )

    def __init__(self, pool: Any, label: str, mode: int, k: int,
                 max_buffered: int | None, retries: int) -> None:
        self.pool, self.tid, self.label = pool, next_tid(), label
        self.mode, self.k, self.max_buffered, self.retries = mode, k, max_buffered, retries
        self.call: Any = None
        self.payload: Value | None = None
        self.entries: list[Entry] = []
        self.items: list[Value] = []
        self.stream: Stream | None = None
        self.produced = self.deps = self.skip = 0
        self.wid: int | None = None
        self.ended = self.cancelled = False


class Worker:
    __slots__ = ("pid", "process", "task", "tasks", "wid")

    def __init__(self, wid: int, process: Any, tasks: Queue) -> None:
        self.wid, self.process, self.tasks = wid, process, tasks
        self.task: Task | None = None
        self.pid = process.pid


def parse_num_returns(num_returns: int | str) -> tuple:
    if num_returns == "dynamic":
        return W.MODE_DYNAMIC, 0
    if num_returns == "streaming":
        return W.MODE_STREAMING, 0
    if isinstance(num_returns, int) and not isinstance(num_returns, bool) and num_returns >= 1:
        return (W.MODE_ONE, 1) if num_returns == 1 else (W.MODE_FIXED, num_returns)
    raise ValueError(f"num_returns must be a positive integer, 'dynamic' or 'streaming', "
                     f"got {num_returns!r}")


def pending_refs(args: tuple, kwargs: dict) -> list[Entry]:
    """Entries of the not-yet-ready refs among the arguments, inside lists, tuples and dicts
    at any depth: the task waits for them (call with STATE held)."""
    found: list[Entry] = []
    todo: list[Any] = [*args, *kwargs.values()]
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if isinstance(obj, Ref):
            if obj._entry.value is None:
                found.append(obj._entry)
        elif isinstance(obj, (list, tuple, dict)) and id(obj) not in seen:
            seen.add(id(obj))
            todo.extend(obj.values() if isinstance(obj, dict) else obj)
        elif isinstance(obj, RefGenerator):
            if obj._stream is not None:
                obj.__reduce__()  # raises TypeError naming the fix
            todo.extend(obj._refs)
    return found


class TaskState:
    """Mixin of TaskPool: the state transitions (attributes are set by TaskPool)."""

    _workers: dict[int, Worker]
    _tasks: dict[int, Task]
    _closing: bool
    _broken: str | None
    _results: Queue
    _idle: deque[int]
    _ready: deque[Task]
    _oom_before: dict[str, int]
    _fault_dir: str  # Note [A DataLoader worker's crash stack]'s files, for the pool's workers
    _wake: Callable[[], None]  # Pump's (tasks/pump.py)
    _owed_workers: int

    def _on_death(self, w: Worker) -> None:
        w.process.join(1.0)
        code = w.process.exitcode
        fault = read_fault_file(fault_path(self._fault_dir, w.pid))  # removes it
        del self._workers[w.wid]
        if w.wid in self._idle:
            self._idle.remove(w.wid)
        task, w.task = w.task, None
        w.process.close()
        w.tasks.close()
        if task is not None and not task.ended:
            if task.retries > 0 and not task.cancelled:
                task.retries -= 1
                task.skip, task.wid = task.produced, None
                self._ready.appendleft(task)
            else:
                reason, why = _exits.explain_exit(code if code is not None else -9,
                                                  oom_before=self._oom_before,
                                                  fault_text=fault)
                self._end(task, error_value(WorkerDiedError(
                    f"worker {w.wid} (pid {w.pid}) of the TaskPool "
                    f"{_exits.summarize(reason, code)} while running task {task.tid} "
                    f"({task.label}), after it produced {task.produced} value(s). {why} The "
                    "pool starts a replacement; submit(..., max_retries=N) re-runs a task "
                    "whose worker dies.", w.pid, code,
                    _exits.signal_name(-code) if code is not None and code < 0 else None)))
        if not self._broken and (self._tasks or not self._closing):
            self._owed_workers += 1  # started by the reader once STATE is released

    def _handle(self, msgs: list) -> None:
        for msg in msgs:
            try:
                self._on_message(msg)
            except Exception:
                log.exception("TaskPool could not handle a worker message %.200r", msg)

    def _on_message(self, msg: tuple) -> None:
        tag, wid = msg[0], msg[1]
        if tag in (W.READY, W.WAKE):
            return
        if tag == W.DIED:  # after everything it sent (Note [Who reads the result queue])
            worker = self._workers.get(wid)
            if worker is not None:
                self._on_death(worker)
            return
        if tag == W.INIT_FAILED:
            text = "".join(str(Value.from_wire(msg[2]).load()).splitlines()[-1:])
            self._broken = (f"a TaskPool worker's initializer raised ({text}); the pool "
                            "stopped: fix the initializer and create a new pool")
            for t in list(self._tasks.values()):
                self._end(t, error_value(PoolClosedError(self._broken)))
            return
        task = self._tasks.get(msg[2])
        if tag == W.ITEM:
            if task is None or task.cancelled:
                discard(msg[4])
                return
            value, index = self._read(msg[4], wid, task, msg[3]), msg[3]
            task.produced = index + 1
            if task.mode == W.MODE_DYNAMIC:
                task.items.append(value)
            elif task.stream is not None:
                task.stream.push(value)
            else:
                self._fill(task.entries[index], value)
        elif tag == W.DONE:
            worker = self._workers.get(wid)
            if worker is not None and worker.task is task:
                worker.task = None
                self._idle.append(wid)
            error = msg[4]
            if task is None:
                if error is not None:
                    discard(error)
                return
            task.produced = msg[3]
            self._end(task, self._read(error, wid, task, msg[3]) if error is not None else None,
                      cancelled=msg[5] == W.FLAG_CANCELLED)
        elif tag == W.WAIT and task is not None and task.stream is not None:
            task.stream.waiting = True
            task.stream.credit()

    def _read(self, wire: Any, wid: int, task: Task, index: int) -> Value:
        """The Value of a wire; if its memory cannot be mapped here (its worker died before
        this process first met its segment: nobody can hand out the fd any more), an error
        value saying so, in its place."""
        try:
            return Value.from_wire(wire)
        except Exception as e:  # noqa: BLE001 (OSError from the fd fetch, CorruptSegmentError)
            worker = self._workers.get(wid)
            pid = worker.pid if worker is not None else None
            return error_value(WorkerDiedError(
                f"value {index} of task {task.tid} ({task.label}) is lost: its worker (pid "
                f"{pid}) died before this process could map the shared memory holding it "
                f"({type(e).__name__}: {e}). Values the caller received before a worker's "
                "death stay readable; this one arrived as the worker died.", pid))

    # -- task state (all with STATE held) ---------------------------------------------------
    def _make_ready(self, task: Task) -> None:
        try:
            task.payload = Value.from_wire(encode(task.call))
        except Exception as e:  # noqa: BLE001 (an argument does not pickle: its refs say so)
            self._end(task, Value.from_wire(encode_error(e)))
            return
        task.call = None
        self._ready.append(task)

    def _dispatch(self) -> None:
        while self._ready and self._idle:
            task = self._ready.popleft()
            if task.ended or task.payload is None:  # ended while it waited
                continue
            worker = self._workers[self._idle.popleft()]
            worker.task, task.wid = task, worker.wid
            consumed = task.stream.consumed if task.stream is not None else 0
            worker.tasks.put((W.TASK, task.tid, task.payload.to_wire(), task.mode, task.k,
                              task.max_buffered or 0, task.skip, consumed))

    def _fill(self, entry: Entry, value: Value) -> None:
        entry.value, entry.pool = value, None
        dependents, entry.dependents = entry.dependents, None
        for task in dependents or ():
            task.deps -= 1
            if task.deps == 0 and not task.ended:
                task.pool._make_ready(task)
                task.pool._dispatch()  # its pool may be another one, its collector asleep

    def _cancel(self, task: Task) -> None:
        """A streaming task's consumer cancelled it (Note [Task protocol])."""
        task.cancelled = True
        if task.wid is None:
            self._end(task, None, cancelled=True)
        else:
            self._workers[task.wid].tasks.put((W.CANCEL, task.tid))

    def _end(self, task: Task, error: Value | None, cancelled: bool = False) -> None:
        """The task ended in its worker (or will never run): settle every ref it owes."""
        task.ended = True
        self._tasks.pop(task.tid, None)
        task.payload = task.call = None
        self._wake()  # ended by a thread not reading results: wake the one that does
        if task.stream is not None:
            task.stream.finish(error, cancelled)
            return
        if task.mode == W.MODE_DYNAMIC:
            refs = [Ref(Entry((task.tid, i, task.label), v)) for i, v in enumerate(task.items)]
            if error is not None:
                refs.append(Ref(Entry((task.tid, len(refs), task.label), error)))
            task.items = []
            self._fill(task.entries[0], Value.from_wire(encode(RefGenerator(refs))))
            return
        for entry in task.entries:
            if entry.value is None:
                self._fill(entry, error or error_value(RuntimeError(
                    f"task {task.tid} ({task.label}) ended without this value (a bug in "
                    "torch_mp_ext: please report it)")))
