"""Refs to task values (possibly not produced yet), RefGenerator, and ``get``/``wait``.

A :class:`Ref` names one value of one task; its value lives in the arena and every copy of the
Ref, in any process, holds it (Note [Every Ref copy holds its value] in ``tasks/values.py``).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ..errors import GetTimeoutError
from ..timeouts import seconds
from .values import Value

__all__ = ["STATE", "Ref", "RefGenerator", "get", "wait"]

#: One lock for the state of every pool and entry; notified whenever a value arrives.
STATE = threading.Condition(threading.RLock())


# ---- refs -----------------------------------------------------------------------------------


class Entry:
    """Where a Ref's value arrives (shared by the copies of one Ref in one process)."""

    __slots__ = ("__weakref__", "dependents", "oid", "pool", "value")

    def __init__(self, oid: tuple, value: Value | None = None, pool: Any = None) -> None:
        self.oid = oid  # (task id, index, label)
        self.value = value
        self.dependents: list | None = None
        self.pool = pool  # the TaskPool that fills it, while it is pending

    def wait(self, timeout: float | None) -> Value:
        timeout = seconds(timeout)  # Note [Timeout values]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with STATE:
                if self.value is not None:
                    self.pool = None
                    return self.value
                if deadline is not None and time.monotonic() >= deadline:
                    raise GetTimeoutError(
                        f"{_describe(self.oid)} was not ready within {timeout} s; the task "
                        "goes on: call get() again, or pass timeout=None to wait for it")
                pool = self.pool
            if pool is not None:
                pool._await(lambda: self.value is not None, deadline)
            else:
                with STATE:
                    if self.value is None:
                        STATE.wait(None if deadline is None else
                                   max(0.0, deadline - time.monotonic()))


def _describe(oid: tuple) -> str:
    tid, index, label = oid
    return f"value {index} of task {tid} ({label})"


class Ref:
    """A value a task produces, possibly not yet: read it with :meth:`get`.

    Refs pickle: pass them to other tasks (a top-level argument arrives as its value, a
    nested one as a Ref whose :meth:`get` works in the worker), or put them in values. Every
    copy in every process keeps the value alive; it is freed when the last copy goes.

    Example:
        ```python
        import torch_mp_ext as mp

        if __name__ == "__main__":
            with mp.TaskPool(1, start_method="fork") as pool:
                ref = pool.submit(sum, [1, 2, 3])
                total = pool.submit(abs, ref)   # a ref as an argument: the value, resolved
                assert ref.get(timeout=60) == 6 and total.get(timeout=60) == 6
        ```
    """

    __slots__ = ("__weakref__", "_entry")

    def __init__(self, entry: Entry) -> None:
        self._entry = entry

    def ready(self) -> bool:
        """True once the value (or the task's error) is there: :meth:`get` will not block."""
        return self._entry.value is not None

    def get(self, timeout: float | None = None) -> Any:
        """The value, waiting for it at most ``timeout`` seconds (``None``: for ever).

        Tensors and numpy arrays come back zero-copy, viewing the arena block the worker
        wrote; every call unpickles anew (tensors of one value share their storage).

        Raises:
            GetTimeoutError: not ready in time (a ``TimeoutError``).
            Exception: the task's own exception, with the worker's traceback as
                ``__cause__``; or ``WorkerDiedError``, ``ReturnCountError``,
                ``TaskCancelledError`` (see docs/tasks.md).
        """
        value = self._entry.value
        if value is None:
            value = self._entry.wait(timeout)
        return value.result()

    def __reduce__(self) -> tuple:
        value = self._entry.value
        if value is None:
            raise ValueError(
                f"{self!r} is not ready, so it cannot be pickled yet: pass it to "
                "TaskPool.submit as an argument (alone or in lists, tuples and dicts: the "
                "task waits for it), or wait for it (get(), ready()) before pickling it")
        return (_rebuild_ref, (self._entry.oid, value.to_wire()))

    def __repr__(self) -> str:
        tid, index, label = self._entry.oid
        state = "ready" if self._entry.value is not None else "pending"
        return f"Ref(task={tid}, index={index}, fn={label}, {state})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ref) and other._entry.oid == self._entry.oid

    def __hash__(self) -> int:
        return hash(self._entry.oid)


def _rebuild_ref(oid: tuple, wire: tuple) -> Ref:
    # Not a dropper: a dropped frame releases the Ref's wire by its own (Note [Dropped wires]).
    return Ref(Entry(oid, Value.from_wire(wire)))


class RefGenerator:
    """An iterator of :class:`Ref`: the value of a ``num_returns="dynamic"`` task (all its
    refs, the task's exception last if it raised), or what ``num_returns="streaming"``
    returns (each ref as soon as the worker yields it).

    A streaming generator raises the task's exception at the position where the task raised
    it, waits with :meth:`next` (``timeout``), stops the task with :meth:`cancel` and
    cannot be pickled; a dynamic one pickles (pass it to another task).

    Example:
        ```python
        import torch_mp_ext as mp

        def count(n):
            yield from range(n)

        if __name__ == "__main__":
            with mp.TaskPool(1, start_method="fork") as pool:
                ref = pool.submit(count, 3, num_returns="dynamic")
                gen = ref.get(timeout=60)   # a RefGenerator, once the task has ended
                assert isinstance(gen, mp.RefGenerator)
                assert mp.get(list(gen), timeout=60) == [0, 1, 2]
        ```
    """

    def __init__(self, refs: Iterable[Ref] = (), *, _stream: Any = None) -> None:
        self._refs = deque(refs)
        self._stream = _stream

    def __iter__(self) -> Iterator[Ref]:
        return self

    def __next__(self) -> Ref:
        return self.next()

    def next(self, timeout: float | None = None) -> Ref:
        """The next ref, waiting at most ``timeout`` seconds for the worker to yield it.

        Raises:
            StopIteration: the task has finished and every ref was returned.
            GetTimeoutError: nothing new in time (call again: nothing is lost).
            TaskCancelledError: after :meth:`cancel`.
            Exception: a streaming task's exception, where it raised it.
        """
        if self._stream is not None:
            return self._stream.next(seconds(timeout))
        if not self._refs:
            raise StopIteration
        return self._refs.popleft()

    def cancel(self) -> None:
        """Stops a streaming task: the worker closes the generator at its next ``yield``
        (``GeneratorExit`` there: its ``finally`` blocks run) and takes the next task.
        Refs already returned stay valid; values not yet returned are freed. Does not wait:
        see :meth:`join`."""
        if self._stream is not None:
            self._stream.cancel()

    def join(self, timeout: float | None = None) -> bool:
        """Waits until the task has ended in its worker (finished, raised, cancelled or its
        worker died); returns False if ``timeout`` passed first."""
        if self._stream is None:
            return True
        return self._stream.join(seconds(timeout))

    def completed(self) -> bool:
        """True once the task has ended in its worker."""
        return self._stream is None or self._stream.finished

    def __len__(self) -> int:
        if self._stream is not None:
            raise TypeError("a streaming RefGenerator has no length until it ends: iterate it")
        return len(self._refs)

    def __reduce__(self) -> tuple:
        if self._stream is not None:
            raise TypeError(
                "a streaming RefGenerator cannot be pickled or passed to a task (it is fed by "
                "its pool in this process): pass list(gen) once it ends, or submit the "
                "producer with num_returns='dynamic'")
        return (RefGenerator, (list(self._refs),))

    def __repr__(self) -> str:
        if self._stream is not None:
            return f"<RefGenerator streaming {self._stream.describe()}>"
        return f"<RefGenerator of {len(self._refs)} refs>"

    def __del__(self) -> None:
        stream = self._stream
        if stream is not None and not stream.finished and not sys.is_finalizing():
            try:
                stream.cancel()  # nobody can reach its later values any more
            except Exception:  # noqa: BLE001 (interpreter shutdown)
                pass


# ---- get / wait -----------------------------------------------------------------------------


def get(refs: Ref | Sequence[Ref], timeout: float | None = None) -> Any:
    """The value of a :class:`Ref`, or the list of values of a list of refs.

    Args:
        refs: a Ref, or a list/tuple of them.
        timeout: most seconds to wait for all of them together (``None``: for ever).

    Raises:
        GetTimeoutError: not all ready in time. Whatever :meth:`Ref.get` raises.
        TypeError: ``refs`` holds something else than refs.

    Example:
        ```python
        import torch_mp_ext as mp

        if __name__ == "__main__":
            with mp.TaskPool(2, start_method="fork") as pool:
                refs = [pool.submit(pow, i, 2) for i in range(4)]
                assert mp.get(refs, timeout=60) == [0, 1, 4, 9]
        ```
    """
    if isinstance(refs, Ref):
        return refs.get(timeout)
    if not isinstance(refs, (list, tuple)) or not all(isinstance(r, Ref) for r in refs):
        raise TypeError(f"get() takes a Ref or a list of Refs, got {type(refs).__name__}")
    timeout = seconds(timeout)
    if timeout is None:
        return [r.get() for r in refs]
    deadline = time.monotonic() + timeout
    return [r.get(max(0.0, deadline - time.monotonic())) for r in refs]


def wait(refs: Sequence[Ref], num_returns: int = 1,
         timeout: float | None = None) -> tuple[list[Ref], list[Ref]]:
    """Waits until ``num_returns`` of ``refs`` are ready, or ``timeout`` seconds passed.

    Args:
        refs: refs of any tasks of any pools.
        num_returns: how many ready refs to wait for.
        timeout: most seconds to wait (``None``: until ``num_returns`` are ready).

    Returns:
        ``(ready, not_ready)``: at most ``num_returns`` ready refs and the others, each in
        the order given (Ray's ``ray.wait``).

    Raises:
        ValueError: ``num_returns`` is not between 1 and ``len(refs)``.

    Example:
        ```python
        import time
        import torch_mp_ext as mp

        if __name__ == "__main__":
            with mp.TaskPool(2, start_method="fork") as pool:
                refs = [pool.submit(time.sleep, s) for s in (0.0, 2.0)]
                ready, pending = mp.wait(refs, num_returns=1, timeout=60)
                assert ready == refs[:1] and pending == refs[1:]
        ```
    """
    refs = list(refs)
    if not all(isinstance(r, Ref) for r in refs):
        raise TypeError("wait() takes a list of Refs")
    if isinstance(num_returns, bool) or not isinstance(num_returns, int):
        raise TypeError(f"num_returns must be an integer, got {type(num_returns).__name__}")
    if not 1 <= num_returns <= len(refs):  # wait([]) would wait for ever
        raise ValueError(f"num_returns must be between 1 and len(refs) = {len(refs)}, "
                         f"got {num_returns!r}")
    timeout = seconds(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    with STATE:
        while True:
            ready = [r for r in refs if r.ready()][:num_returns]
            remaining = None if deadline is None else deadline - time.monotonic()
            if len(ready) >= num_returns or (remaining is not None and remaining <= 0):
                chosen = set(map(id, ready))
                return ready, [r for r in refs if id(r) not in chosen]
            STATE.wait(remaining)
