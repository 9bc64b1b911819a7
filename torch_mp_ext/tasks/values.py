"""Task values in the arena: pickles whose tensors are block handles, held by every Ref copy.

Note [Task values]
A value a task produced is its pickle (``_pickling.dumps``): tensors and numpy arrays inside
are block handles (``reductions.py``), so the pickle is a few dozen bytes per tensor whatever
its size, and the data stays in the arena block the worker wrote it to. A pickle larger than
``INLINE_MAX`` (a big list, a long string) goes into an arena block of its own, a *box*, and
the message carries the box's handle. On the wire a value is ``(kind, payload)``: ``kind`` is
``VALUE`` or ``ERROR`` (the pickle of the task's exception, with its traceback), ``payload`` the
pickle's bytes or ``(box handle, nbytes)``.

Note [Dropped wires]
A wire in a queue frame (a TASK's payload, an ITEM's value, a DONE's error, a Ref inside a
value) holds references its frame's pickle cannot show: the handles are inside the nested
pickle, or name the box. So a wire travels as a :class:`Wire` (a tuple that pickles as a call
of ``_wire``), and ``_wire`` is one of ``release_frame``'s ``DROPPERS``: a frame dropped unread
(a pool terminated with a task in a worker's queue, items nobody will read when the result
queue closes) releases, through ``release_frame`` alone, every reference of every wire in
it, nested ones and boxes included. ``discard`` is that same dropper, for a wire already
read out of its frame. A wire that holds no reference (an inline pickle without a handle in
it: the usual small value) stays a plain tuple: dropping it has nothing to release, and it
costs neither a ``__reduce__`` call to pickle nor a global lookup to unpickle (a Wire made
streaming ints 1.7x slower per item).

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
import logging
import os
import pickle
from typing import Any, Union

from .. import _C
from ..errors import RemoteTaskError, with_traceback
from ..sharing import pickling as _pickling
from ..sharing.pickling import PLAIN_TYPES, PROTOCOL, TAG_PICKLE, dumps, loads, release_frame

__all__ = ["ERROR", "INLINE_MAX", "VALUE", "Value", "Wire", "discard", "encode", "encode_error"]

log = logging.getLogger("torch_mp_ext.tasks")

VALUE = 0
ERROR = 1
#: Pickles larger than this travel in an arena block of their own (Note [Task values]).
_plain_dumps = pickle.dumps
INLINE_MAX = int(os.environ.get("TORCH_MP_EXT_TASK_INLINE_BYTES", 64 * 1024))

_MARK = b"torch_mp_ext"  # in every pickle that holds a handle; absent: nothing to walk
_REBUILDERS = {"rebuild_storage": 1, "rebuild_cpu_tensor": 0, "rebuild_array": 0}
_REF_MODULE = "torch_mp_ext.tasks.refs"



class Wire(tuple):
    """A wire value, ``(kind, payload)``, that pickles as ``_wire(kind, payload)``: a frame
    dropped unread releases its references (Note [Dropped wires]). Unpickled, it is a plain
    tuple."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        return (_wire, tuple(self))


def _wire(kind: int, payload: Union[bytes, tuple[tuple, int]]) -> tuple:
    return (kind, payload)


class _Collector(pickle.Unpickler):
    """Walks a pickle without running it, adopting every block handle in it.

    What ``find_class`` returns must not refer to the collector: the unpickler's memo keeps
    it, and a cycle would keep ``blocks`` (the Value's references) alive until a GC pass.
    """

    def __init__(self, data: Any, blocks: list[_C.Block]) -> None:
        super().__init__(io.BytesIO(data))
        self.blocks = blocks

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch_mp_ext.reductions" and name in _REBUILDERS:
            return functools.partial(_adopt, self.blocks, _REBUILDERS[name])
        if module == _REF_MODULE and name == "_rebuild_ref":
            return functools.partial(_adopt_nested, self.blocks)
        if module == __name__ and name == "_wire":
            return _wire
        return _pickling.Inert


def _adopt(blocks: list[_C.Block], position: int, *args: Any) -> None:
    blocks.append(_C.attach(args[position]))


def _adopt_nested(blocks: list[_C.Block], oid: Any, wire: tuple) -> None:
    box = _collect_wire(wire, blocks)[1]
    if box is not None:
        blocks.append(box)


def _collect_wire(wire: tuple, blocks: list[_C.Block]) -> tuple[Any, _C.Block | None]:
    """(the pickle, its box or None), adopting the handles inside the pickle into ``blocks``."""
    payload = wire[1]
    box = None
    if isinstance(payload, bytes):
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

    __slots__ = ("blocks", "box", "data", "kind")

    def __init__(self, kind: int, data: Any, box: _C.Block | None,
                 blocks: list[_C.Block]) -> None:
        self.kind = kind
        self.data = data
        self.box = box
        self.blocks = blocks

    @classmethod
    def from_wire(cls, wire: tuple) -> Value:
        """Takes over the references a wire value carries."""
        blocks: list[_C.Block] = []
        data, box = _collect_wire(wire, blocks)
        return cls(wire[0], data, box, blocks)

    def to_wire(self) -> Wire | tuple:
        """A wire copy carrying references of its own."""
        for block in self.blocks:
            block.share()
        if self.box is None:  # Note [Dropped wires]: plain when it holds no reference
            return Wire((self.kind, self.data)) if self.blocks else (self.kind, self.data)
        return Wire((self.kind, (self.box.share(), len(self.data))))

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
        except Exception as e:
            raise RemoteTaskError(
                f"the task raised an exception that cannot be unpickled in this process "
                f"({type(e).__name__}: {e}): make its class importable here") from e
        raise exc


def encode(obj: Any, kind: int = VALUE) -> Wire | tuple:
    """Pickles ``obj`` as a wire value; a large pickle goes into a box."""
    if type(obj) in PLAIN_TYPES:  # an int, a str...: no reducer, no handle
        data = _plain_dumps(obj, PROTOCOL)
        if len(data) <= INLINE_MAX:
            return (kind, data)
    else:
        data = dumps(obj)
    if len(data) <= INLINE_MAX:  # Note [Dropped wires]: plain when it holds no reference
        return Wire((kind, data)) if _MARK in data else (kind, data)
    box = _C.allocate(len(data))
    memoryview(box)[: len(data)] = data
    return Wire((kind, (box.share(), len(data))))


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


def discard(wire: tuple) -> None:
    """Drops the references of a wire value nobody will read; never raises.

    The dropper ``release_frame`` calls for every wire in a dropped frame (Note [Dropped
    wires]): one release path, whether the wire was read out of its frame or not.
    """
    kind, payload = wire
    if isinstance(payload, bytes):
        release_frame(TAG_PICKLE, payload)
        return
    try:
        box = _C.attach(payload[0])  # takes over the box's reference: it goes with ``box``
        view = memoryview(box)[: payload[1]]
        try:
            release_frame(TAG_PICKLE, view)
        finally:
            view.release()
    except Exception:
        log.debug("could not release the references of a dropped task value", exc_info=True)


def _drop_wire(kind: int, payload: Union[bytes, tuple[tuple, int]]) -> None:
    discard((kind, payload))


# Note [Dropped wires]: a frame dropped unread releases the wires inside it.
_pickling.DROPPERS[(__name__, "_wire")] = _drop_wire
