"""Refs to task values: where a value lives, how every copy of a Ref keeps it alive, get/wait.

Note [Task values]
A value a task produced is its pickle (``_pickling.dumps``): tensors and numpy arrays inside
are block handles (``reductions.py``), so the pickle is a few dozen bytes per tensor whatever
its size, and the data stays in the arena block the worker wrote it to. A pickle larger than
``INLINE_MAX`` (a big list, a long string) goes into an arena block of its own, a *box*, and
the message carries the box's handle. On the wire a value is ``(kind, payload)``: ``kind`` is
``VALUE`` or ``ERROR`` (the pickle of the task's exception, with its traceback), ``payload`` the
pickle's bytes or ``(box handle, nbytes)``.

Note [Every Ref copy holds its value]
Each handle inside a pickle carries one counted reference (Note [Block lifetime] in
``csrc/shm/layout.h``). A :class:`Value` takes those references over as :class:`_C.Block`
objects, one per handle in the pickle (nested refs and boxes included), found by walking the
pickle without running it (``_Collector``). Then:

- reading the value (``get``) first adds one reference per block (``Block.share()``): the
  ordinary rebuild functions take those over, and the Value keeps its own;
- pickling a :class:`Ref` (into a task's arguments, or inside another value) does the same:
  the message carries its own references, and the receiving process's Ref copy takes them;
- a Ref copy that dies drops its Value's blocks.

So a value lives exactly as long as some Ref copy to it lives in some process (or a message
carrying one is in flight), and the last one to go frees it, wherever that is. No process
asks another for a value: a task given a Ref reads it from shared memory, the caller never
touches it. What this cannot duplicate are handles that torch itself issues (tensors that
``share_memory_()`` or a DataLoader put in torch's shared memory, CUDA tensors): those are
one-shot, so such a value can be read once.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import threading
import time
from collections import deque
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from . import _C, _pickling
from ._pickling import TAG_PICKLE, dumps, loads, release_frame
from .errors import GetTimeoutError, RemoteTaskError, with_traceback

__all__ = ["Ref", "RefGenerator", "Value", "encode", "encode_error", "discard", "get", "wait",
           "STATE", "VALUE", "ERROR"]

VALUE = 0
ERROR = 1
#: Pickles larger than this travel in an arena block of their own (Note [Task values]).
INLINE_MAX = int(os.environ.get("TORCH_MP_EXT_TASK_INLINE_BYTES", 64 * 1024))

#: One lock for the state of every pool and entry; notified whenever a value arrives.
STATE = threading.Condition(threading.RLock())

_MARK = b"torch_mp_ext"  # in every pickle that holds a handle; absent: nothing to walk
_REBUILDERS = {"rebuild_storage": 1, "rebuild_cpu_tensor": 0, "rebuild_array": 0}

Wire = Tuple[int, Union[bytes, Tuple[tuple, int]]]


# ---- values ---------------------------------------------------------------------------------


class _Collector(pickle.Unpickler):
    """Walks a pickle without running it, adopting every block handle in it.

    What ``find_class`` returns must not refer to the collector: the unpickler's memo keeps
    it, and a cycle would keep ``blocks`` (the Value's references) alive until a GC pass.
    """

    def __init__(self, data: Any, blocks: List["_C.Block"]) -> None:
        super().__init__(io.BytesIO(data))
        self.blocks = blocks

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch_mp_ext.reductions" and name in _REBUILDERS:
            return functools.partial(_adopt, self.blocks, _REBUILDERS[name])
        if module == __name__ and name == "_rebuild_ref":
            return functools.partial(_adopt_nested, self.blocks)
        return _pickling._Inert


def _adopt(blocks: List["_C.Block"], position: int, *args: Any) -> None:
    blocks.append(_C.attach(args[position]))


def _adopt_nested(blocks: List["_C.Block"], oid: Any, wire: Wire) -> None:
    box = _collect_wire(wire, blocks)[1]
    if box is not None:
        blocks.append(box)


def _collect_wire(wire: Wire, blocks: List["_C.Block"]) -> Tuple[Any, Optional["_C.Block"]]:
    """(the pickle, its box or None), adopting the handles inside the pickle into ``blocks``."""
    payload = wire[1]
    box = None
    if type(payload) is bytes:
        data: Any = payload
    else:
        box = _C.attach(payload[0])
        data = memoryview(box)[: payload[1]]
    if box is not None or _MARK in data:
        _Collector(data, blocks).load()
    return data, box


class Value:
    """One holder of a task value in the arena (Note [Every Ref copy holds its value]).

    ``blocks`` are the references the handles inside the pickle carry (nested boxes
    included); ``box`` holds the pickle itself when it is not inline.
    """

    __slots__ = ("kind", "data", "box", "blocks")

    def __init__(self, kind: int, data: Any, box: Optional["_C.Block"],
                 blocks: List["_C.Block"]) -> None:
        self.kind = kind
        self.data = data
        self.box = box
        self.blocks = blocks

    @classmethod
    def from_wire(cls, wire: Wire) -> "Value":
        """Takes over the references a wire value carries."""
        blocks: List[_C.Block] = []
        data, box = _collect_wire(wire, blocks)
        return cls(wire[0], data, box, blocks)

    def to_wire(self) -> Wire:
        """A wire copy carrying references of its own."""
        for block in self.blocks:
            block.share()
        if self.box is None:
            return (self.kind, self.data)
        return (self.kind, (self.box.share(), len(self.data)))

    def load(self) -> Any:
        """The object (for ``ERROR``: the exception, not raised)."""
        for block in self.blocks:
            block.share()
        return loads(self.data)

    def result(self) -> Any:
        """The object, or raises the task's exception."""
        if self.kind != ERROR:
            return self.load()
        try:
            exc = self.load()
        except Exception as e:  # noqa: BLE001 (its class does not import here, ...)
            raise RemoteTaskError(
                f"the task raised an exception that cannot be unpickled in this process "
                f"({type(e).__name__}: {e}): make its class importable here") from e
        raise exc


def encode(obj: Any, kind: int = VALUE) -> Wire:
    """Pickles ``obj`` as a wire value; a large pickle goes into a box."""
    data = dumps(obj)
    if len(data) <= INLINE_MAX:
        return (kind, data)
    box = _C.allocate(len(data))
    memoryview(box)[: len(data)] = data
    return (kind, (box.share(), len(data)))


def encode_error(exc: BaseException) -> Wire:
    """The wire value of a task's exception, with its traceback as ``__cause__`` once read;
    an exception that does not pickle becomes a :class:`RemoteTaskError` holding its text."""
    try:
        return encode(with_traceback(exc), ERROR)
    except Exception:  # noqa: BLE001 (whatever pickling raised: the text travels instead)
        import traceback

        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return encode(RemoteTaskError(
            f"the task raised {type(exc).__qualname__}: {exc} (the exception could not be "
            f"pickled; its traceback is in .traceback)", text), ERROR)


def discard(wire: Wire) -> None:
    """Drops the references of a wire value nobody will read; never raises."""
    payload = wire[1]
    if type(payload) is bytes:
        release_frame(TAG_PICKLE, payload)
        return
    try:
        box = _C.attach(payload[0])
        release_frame(TAG_PICKLE, bytes(memoryview(box)[: payload[1]]))
    except Exception:  # noqa: BLE001 (as for a dropped queue frame: the reference stays)
        pass


def _drop_ref(oid: Any, wire: Wire) -> None:
    discard(wire)


# A queue frame dropped unread (a task message never taken) releases the refs inside it.
_pickling._DROPPERS[(__name__, "_rebuild_ref")] = _drop_ref


# ---- refs -----------------------------------------------------------------------------------


class _Entry:
    """Where a Ref's value arrives (shared by the copies of one Ref in one process)."""

    __slots__ = ("oid", "value", "dependents", "pool", "__weakref__")

    def __init__(self, oid: tuple, value: Optional[Value] = None, pool: Any = None) -> None:
        self.oid = oid  # (task id, index, label)
        self.value = value
        self.dependents: Optional[list] = None
        self.pool = pool  # the TaskPool that fills it, while it is pending

    def wait(self, timeout: Optional[float]) -> Value:
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
    """

    __slots__ = ("_entry", "__weakref__")

    def __init__(self, entry: _Entry) -> None:
        self._entry = entry

    def ready(self) -> bool:
        """True once the value (or the task's error) is there: :meth:`get` will not block."""
        return self._entry.value is not None

    def get(self, timeout: Optional[float] = None) -> Any:
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
                f"{self!r} is not ready, so it cannot be pickled: pass it to "
                "TaskPool.submit (which waits for it), or get() it first")
        return (_rebuild_ref, (self._entry.oid, value.to_wire()))

    def __repr__(self) -> str:
        tid, index, label = self._entry.oid
        state = "ready" if self._entry.value is not None else "pending"
        return f"Ref(task={tid}, index={index}, fn={label}, {state})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ref) and other._entry.oid == self._entry.oid

    def __hash__(self) -> int:
        return hash(self._entry.oid)


def _rebuild_ref(oid: tuple, wire: Wire) -> Ref:
    return Ref(_Entry(oid, Value.from_wire(wire)))


class RefGenerator:
    """An iterator of :class:`Ref`: the value of a ``num_returns="dynamic"`` task (all its
    refs, the task's exception last if it raised), or what ``num_returns="streaming"``
    returns (each ref as soon as the worker yields it).

    A streaming generator raises the task's exception at the position where the task raised
    it, waits with :meth:`next` (``timeout``), stops the task with :meth:`cancel` and
    cannot be pickled; a dynamic one pickles (pass it to another task).
    """

    def __init__(self, refs: Iterable[Ref] = (), *, _stream: Any = None) -> None:
        self._refs = deque(refs)
        self._stream = _stream

    def __iter__(self) -> Iterator[Ref]:
        return self

    def __next__(self) -> Ref:
        return self.next()

    def next(self, timeout: Optional[float] = None) -> Ref:
        """The next ref, waiting at most ``timeout`` seconds for the worker to yield it.

        Raises:
            StopIteration: the task has finished and every ref was returned.
            GetTimeoutError: nothing new in time (call again: nothing is lost).
            TaskCancelledError: after :meth:`cancel`.
            Exception: a streaming task's exception, where it raised it.
        """
        if self._stream is not None:
            return self._stream.next(timeout)
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

    def join(self, timeout: Optional[float] = None) -> bool:
        """Waits until the task has ended in its worker (finished, raised, cancelled or its
        worker died); returns False if ``timeout`` passed first."""
        if self._stream is None:
            return True
        return self._stream.join(timeout)

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
        if stream is not None and not stream.finished:
            try:
                stream.cancel()  # nobody can reach its later values any more
            except Exception:  # noqa: BLE001 (interpreter shutdown)
                pass


# ---- get / wait -----------------------------------------------------------------------------


def get(refs: Union[Ref, Sequence[Ref]], timeout: Optional[float] = None) -> Any:
    """The value of a :class:`Ref`, or the list of values of a list of refs.

    Args:
        refs: a Ref, or a list/tuple of them.
        timeout: most seconds to wait for all of them together (``None``: for ever).

    Raises:
        GetTimeoutError: not all ready in time. Whatever :meth:`Ref.get` raises.
        TypeError: ``refs`` holds something else than refs.
    """
    if isinstance(refs, Ref):
        return refs.get(timeout)
    if not isinstance(refs, (list, tuple)) or not all(isinstance(r, Ref) for r in refs):
        raise TypeError(f"get() takes a Ref or a list of Refs, got {type(refs).__name__}")
    if timeout is None:
        return [r.get() for r in refs]
    deadline = time.monotonic() + timeout
    return [r.get(max(0.0, deadline - time.monotonic())) for r in refs]


def wait(refs: Sequence[Ref], num_returns: int = 1,
         timeout: Optional[float] = None) -> Tuple[List[Ref], List[Ref]]:
    """Waits until ``num_returns`` of ``refs`` are ready, or ``timeout`` seconds passed.

    Returns:
        ``(ready, not_ready)``: at most ``num_returns`` ready refs and the others, each in
        the order given (Ray's ``ray.wait``).

    Raises:
        ValueError: ``num_returns`` is not between 1 and ``len(refs)``.
    """
    refs = list(refs)
    if not all(isinstance(r, Ref) for r in refs):
        raise TypeError("wait() takes a list of Refs")
    if isinstance(num_returns, bool) or not 1 <= num_returns <= max(len(refs), 1):
        raise ValueError(f"num_returns must be between 1 and len(refs) = {len(refs)}, "
                         f"got {num_returns!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    with STATE:
        while True:
            ready = [r for r in refs if r.ready()][:num_returns]
            remaining = None if deadline is None else deadline - time.monotonic()
            if len(ready) >= num_returns or (remaining is not None and remaining <= 0):
                chosen = set(map(id, ready))
                return ready, [r for r in refs if id(r) not in chosen]
            STATE.wait(remaining)
