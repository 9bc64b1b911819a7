"""The caller's side of a ``num_returns="streaming"`` task: what its RefGenerator reads.

The pool's collector thread pushes each value as the worker's message arrives; the consumer's
``next()`` takes them in order, sends the worker a credit when back-pressure held it
(Note [Task protocol] in ``tasks/pool.py``), and raises the task's exception where the task
raised it. Everything here runs with ``STATE`` held.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from ..errors import GetTimeoutError, TaskCancelledError
from . import worker as W
from .refs import STATE, Entry, Ref
from .values import Value

__all__ = ["Stream"]


class Stream:
    """Values of one streaming task, between the collector thread and the consumer."""

    __slots__ = ("buffer", "cancelled", "consumed", "error", "finished", "task", "waiting")

    def __init__(self, task: Any) -> None:
        self.task = task
        self.buffer: deque = deque()
        self.consumed = 0
        self.error: Value | None = None
        self.cancelled = False
        self.waiting = False  # the worker is held by back-pressure
        self.finished = False  # the task ended in its worker

    def describe(self) -> str:
        state = "cancelled" if self.cancelled else "ended" if self.finished else "running"
        return (f"task {self.task.tid} ({self.task.label}), {state}, {self.consumed} taken, "
                f"{len(self.buffer)} buffered")

    def push(self, value: Value) -> None:
        if not self.cancelled:
            self.buffer.append(value)

    def finish(self, error: Value | None, cancelled: bool) -> None:
        self.finished = True
        self.waiting = False
        if cancelled:
            self.cancelled = True
            self.buffer.clear()
        else:
            self.error = error

    def credit(self) -> None:
        """Lets a worker held by back-pressure go on once the consumer caught up."""
        task = self.task
        if (self.waiting and not self.finished and task.wid is not None
                and (not task.max_buffered or task.produced - self.consumed < task.max_buffered)):
            worker = task.pool._workers.get(task.wid)
            if worker is not None:
                worker.tasks.put((W.CREDIT, task.tid, self.consumed))
                self.waiting = False

    def next(self, timeout: float | None) -> Ref:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with STATE:
                if self.cancelled:
                    raise TaskCancelledError(
                        f"task {self.task.tid} ({self.task.label}) was cancelled: the refs it "
                        "returned before stay valid, no more will come")
                if self.buffer:
                    value = self.buffer.popleft()
                    index = self.consumed
                    self.consumed += 1
                    self.credit()
                    return Ref(Entry((self.task.tid, index, self.task.label), value))
                if self.finished:
                    error, self.error = self.error, None
                    if error is not None:
                        error.result()  # raises the task's exception, where it raised it
                    raise StopIteration
                if deadline is not None and time.monotonic() >= deadline:
                    raise GetTimeoutError(
                        f"task {self.task.tid} ({self.task.label}) yielded no new value within "
                        f"{timeout} s; it goes on: call next() again")
            self.task.pool._await(self._ready, deadline)

    def _ready(self) -> bool:
        return bool(self.buffer) or self.finished or self.cancelled

    def cancel(self) -> None:
        with STATE:
            if self.cancelled:
                return
            self.cancelled = True
            self.buffer.clear()
            if not self.finished and not self.task.cancelled:
                self.task.pool._cancel(self.task)
            STATE.notify_all()
            self.task.pool._wake()  # a next() in another thread may be reading results

    def join(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.task.pool._await(lambda: self.finished, deadline)
        with STATE:
            return self.finished
