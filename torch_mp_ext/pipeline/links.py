"""The queues between pipeline stages: who writes to which, who reads which, and what besides
items travels on them (the end of the stream, a failure).

Note [Pipeline links]
Each side of a link is a group of processes: one (the source, a generator stage, the
consumer) or ``workers`` of them (a per-item stage). Every per-item stage of a pipeline has
the same number of workers W, so a link has one of four shapes::

    1 -> 1   one queue
    1 -> W   ordered:   a queue per worker; item k goes to queue k % W, END to every queue
             unordered: one queue the workers share; W ENDs follow the last item
    W -> W   a queue per lane: worker w feeds worker w (ordered, item k stays in lane k % W)
    W -> 1   ordered:   a queue per worker, read round robin: item k from queue k % W, and
                        the first END read ends the stream (lane k % W had no item k)
             unordered: one shared queue; the stream ends after W ENDs

Every queue holds at most ``buffer_size`` items. In ordered mode a slow item holds back the
items behind it (they wait in their lanes' queues), which is what keeps order and memory
bounded without a reorder buffer; unordered mode lets free workers take the next item.

Note [Pickle once, wait in slices]
A producer pickles an item once (an array not yet in a block is copied into one then), offers the
frame to the ring in slices of ``POLL_S``; between slices it runs its ``idle`` check, which
raises to abandon the put (a stop request, a dead stage). An abandoned frame's block
references are released (Note [Failed puts] in ``queues/ring_queue.py``). Readers wait the
same way.

Note [Produce into room]
A producer waits for room in the queue its next item goes to *before* it makes the item
(``Outlet.reserve``), not after: an item waiting for room would be one more item alive per
link, and with numpy arrays born in blocks an item is shared memory from its first byte.
The wait sleeps on the ring's ``not_full`` condition, as a blocked put does
(``Queue._wait_room``), in slices of ``POLL_S`` for the ``idle`` check: a producer blocked
on a consumer that stopped reading costs no CPU (issue 26: it used to poll ``full()``).
"""

from __future__ import annotations

import pickle
import queue
import traceback
from typing import Any, Callable, List, Optional, Sequence

from ..errors import PipelineError, RemoteTraceback, with_traceback
from ..processes.exits import summarize
from ..queues.ring_queue import Queue
from ..sharing.pickling import dumps, release_frame

__all__ = ["END", "POLL_S", "Failure", "Inlet", "Outlet", "Role", "Stop", "Upstream", "discard"]

#: Seconds a blocked reader or writer waits before it checks whether it should give up.
POLL_S = 0.1


class _Control:
    """Base of what travels on a link besides items."""


class _End(_Control):
    def __reduce__(self) -> str:
        return "END"  # pickled by reference: every process has the one instance

    def __repr__(self) -> str:
        return "END"


#: Follows a producer's last item.
END = _End()


class Stop(BaseException):
    """Raised in a stage to abandon its work: the pipeline is shutting down. A BaseException,
    so that a stage's ``except Exception`` does not swallow it."""


class Role:
    """Which stage (and which of its workers) a process or thread plays, for messages."""

    def __init__(self, name: str, position: int, worker: int = 0, workers: int = 1,
                 pid: Optional[int] = None, local: bool = False) -> None:
        self.name = name
        self.position = position
        self.worker = worker
        self.workers = workers
        self.pid = pid
        self.local = local

    def describe(self, pid: Optional[int]) -> str:
        what = "source" if self.position == 0 else f"stage {self.position}"
        text = f"{what} {self.name!r}"
        if self.workers > 1:
            text += f" (worker {self.worker} of {self.workers}, pid {pid})"
        elif self.local:
            text += " (iterated by a thread of this process)"
        else:
            text += f" (pid {pid})"
        return text


class Failure(_Control):
    """A stage's exception on its way to the consumer, in the stream's order."""

    def __init__(self, role: Role, pid: int, detail: str, payload: Optional[bytes],
                 text: str) -> None:
        self.role = role
        self.pid = pid
        self.detail = detail
        self.payload = payload  # pickled with its traceback; None if it could not be pickled
        self.text = text

    @classmethod
    def capture(cls, exc: BaseException, role: Role, pid: int, detail: str) -> Failure:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            payload: Optional[bytes] = pickle.dumps(with_traceback(exc))
        except Exception:  # noqa: BLE001 (unpicklable: the traceback text travels alone)
            payload = None
        return cls(role, pid, detail, payload, text)

    def error(self) -> PipelineError:
        """The consumer's exception: ``__cause__`` is the stage's, with its remote stack."""
        cause: Optional[BaseException] = None
        if self.payload is not None:
            try:
                cause = pickle.loads(self.payload)
            except Exception:  # noqa: BLE001 (its class cannot be imported here)
                cause = None
        if cause is None:
            cause = RemoteTraceback(self.text)
        message = f"{self.role.describe(self.pid)} {summarize('raised', None, self.text)}"
        err = PipelineError(message + self.detail, stage=self.role.name,
                            position=self.role.position, worker=self.role.worker, pid=self.pid)
        err.__cause__ = cause
        return err


class Upstream(BaseException):
    """Raised from an :class:`Inlet` when a failure record arrives: the stage forwards it."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure)
        self.failure = failure


def _frame(q: Queue, obj: Any) -> bytes:
    data = dumps(obj)
    if len(data) > q._max_payload:
        release_frame(0, data)
        raise q._oversize(obj, len(data))
    return data


class Outlet:
    """One producer's side of a link (Note [Pipeline links]).

    Args:
        targets: the queues it writes, item ``k`` to ``targets[k % len(targets)]``.
        end_copies: ENDs put into each target after the last item.
        idle: called between waits while a queue is full; raises to abandon the put.
    """

    def __init__(self, targets: Sequence[Queue], end_copies: int,
                 idle: Callable[[], None]) -> None:
        self._targets = list(targets)
        self._end_copies = end_copies
        self._idle = idle
        self.count = 0

    def _deliver(self, q: Queue, data: bytes) -> None:
        # Note [Pickle once, wait in slices]
        while not q._put_frame(data, POLL_S):
            try:
                self._idle()
            except BaseException:
                release_frame(0, data)
                raise

    def reserve(self) -> None:
        """Waits until the queue the next item goes to has room (Note [Produce into room]);
        first of all, runs the ``idle`` check: a stopped stage makes no further item."""
        self._idle()
        targets = self._targets
        q = targets[0] if len(targets) == 1 else targets[self.count % len(targets)]
        while not q._wait_room(POLL_S):
            self._idle()

    def put(self, obj: Any) -> None:
        targets = self._targets
        q = targets[0] if len(targets) == 1 else targets[self.count % len(targets)]
        self._deliver(q, _frame(q, obj))
        self.count += 1

    def end(self) -> None:
        for q in self._targets:
            for _ in range(self._end_copies):
                self._deliver(q, _frame(q, END))

    def fail(self, failure: Failure) -> None:
        """Puts a failure where the next item would have gone, so it keeps the stream order."""
        q = self._targets[self.count % len(self._targets)]
        self._deliver(q, _frame(q, failure))


class Inlet:
    """One consumer's side of a link: an iterator over the items (Note [Pipeline links]).

    Args:
        sources: the queues it reads, item ``k`` from ``sources[k % len(sources)]``.
        ends: ENDs that end the stream (the first END read ends it when reading round robin).
        idle: called between waits while the queue is empty; raises to give up.

    Raises:
        Upstream: a failure record arrived (from ``__next__``).
    """

    def __init__(self, sources: Sequence[Queue], ends: int, idle: Callable[[], None]) -> None:
        self._sources = list(sources)
        self._ends_left = ends
        self._idle = idle
        self.count = 0
        self.done = False

    def __iter__(self) -> Inlet:
        return self

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        sources = self._sources
        while True:
            q = sources[0] if len(sources) == 1 else sources[self.count % len(sources)]
            try:
                obj = q.get(True, POLL_S)
            except queue.Empty:
                self._idle()
                continue
            if isinstance(obj, _Control):
                if isinstance(obj, Failure):
                    self.done = True
                    raise Upstream(obj)
                self._ends_left -= 1  # END
                if self._ends_left <= 0 or len(sources) > 1:
                    self.done = True
                    raise StopIteration
                continue
            self.count += 1
            return obj


def discard(queues: List[Queue]) -> None:
    """Drops every frame left in ``queues`` and the block references they hold, without
    unpickling them (no user code runs)."""
    for q in queues:
        for tag, data in q._drain_frames():
            release_frame(tag, data)
