"""How queue items become frames and back, and how a dropped frame frees what it holds.

Note [Pickling queue items]
An item is serialised in the caller's thread, so an unpicklable item raises in ``put`` itself.
The result is what ``multiprocessing.reduction.ForkingPickler`` (protocol 5) would write, so
the reducers registered there apply (tensors, storages and arrays travel as block handles,
see ``reductions.py``), but it is cheaper to get:

- ``bytes`` items are sent as they are (tag ``TAG_BYTES``): pickling them is only a copy;
- ``None``, ``bool``, ``int``, ``float``, ``str``, and tuples of up to 8 of them, go through
  ``pickle.dumps``: no reducer ever applies to them, so the bytes are the same;
- everything else goes through one reused pickler whose ``dispatch_table`` is a live
  view of ForkingPickler's reducers over copyreg's (a new ``ForkingPickler`` copies both
  tables: about 3 µs per item with torch's reducers registered).

Note [Large items out of line]
An item whose frame would be larger than the queue's out-of-line limit (``OOL_BYTES``, 256
KiB, or a quarter of a small explicit ``max_bytes``) does not go through the ring: its pickle
is written once into an arena block (the pickler hands over large ``bytes`` payloads without
copying them, so the item's bytes are copied exactly once on this side), and the ring gets a
frame of tag ``TAG_BLOCK`` whose payload is the plain pickle of ``(inner tag, block handle,
nbytes)``. The handle carries one counted reference, as a tensor's does, so everything that
already holds for handles holds for these frames: a put that fails drops it (Note [Failed
puts] in ``queues.py``), the last holder's drain drops it (walking the block's pickle for the
handles nested in it), a producer that exits while its item is in flight leaves an exit
keeper (Note [Exit keeper] in ``csrc/ipc/fd_keeper.h``), and either sharing strategy works.
The getter maps the block and unpickles straight from it (one copy on its side, into the
objects it builds), then drops the reference. So a 1 GB ``bytes`` crosses with one copy per
side, outside the ring's lock, while the ring itself only holds frames up to the limit (small
items keep the one-memcpy fast path). What a kill loses: a
getter killed after taking the frame and before unpickling it leaves the block referenced
until the block's owner exits (as for any frame); and with the file_descriptor strategy, the
items a producer put out of line are lost if it is SIGKILLed before a getter maps them (its
fd server dies with it, as for a tensor it sent): ``get`` raises ``PeerDiedError`` for such an
item, ``get_many`` leaves it out with a ``RuntimeWarning``, and the queue goes on. A producer
that exits normally leaves an exit keeper, so nothing is lost then.

Note [Releasing dropped frames]
A frame can hold references: every block handle pickled inside it carries one (Note [Block
lifetime] in ``csrc/shm/layout.h``). When the last holder of a queue lets it go with frames
left, each frame is loaded by :class:`_Releaser`, an unpickler that imports nothing: the
reducers' rebuild functions that take over a reference (``rebuild_storage``,
``rebuild_cpu_tensor``, ``rebuild_array``) are replaced by functions that only drop it, and
every other global becomes an inert stand-in that accepts any construction. So the memory of
a tensor put and never taken is freed with the queue, without running user code or needing
the item's classes to be importable in that process. (The alternative, recording the handles
of each frame beside it, would put a second protocol into the reducers for no gain.)
References that torch's own handles carry (CUDA IPC, torch-shared storages) are outside
this: as with ``multiprocessing.Queue``, a message never received leaks what its sender
registered.
"""

from __future__ import annotations

import copyreg
import ctypes
import io
import logging
import os
import pickle
import sys
import threading
from collections import ChainMap
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, List

from .. import _C
from ..errors import PeerDiedError
from . import byvalue as _byvalue
from . import records as _records
from .strategy import get_sharing_strategy

__all__ = ["TAG_PICKLE", "TAG_BYTES", "TAG_BLOCK", "OOL_BYTES", "dumps", "dump_item", "loads",
           "decode", "release_frame", "release_pickle", "to_block"]

log = logging.getLogger(__name__)

TAG_PICKLE = 0
TAG_BYTES = 1
TAG_BLOCK = 2  # Note [Large items out of line]
TAG_RECORD = 3  # Note [Lean tensor records]
#: Frames larger than this go out of line (Note [Large items out of line]).
OOL_BYTES = int(os.environ.get("TORCH_MP_EXT_QUEUE_OOL_BYTES", 256 * 1024))
PROTOCOL = 5
PLAIN_TYPES = frozenset({type(None), bool, int, float, str})
#: Bytes this short inside a small tuple are pickled plainly too (no chunks to keep apart).
PLAIN_BYTES = 64 * 1024

loads = pickle.loads
_plain_dumps = pickle.dumps


class _Sink:
    __slots__ = ("write",)

    def __init__(self, write: Callable[[bytes], Any]) -> None:
        self.write = write


class _QueuePickler(pickle.Pickler):
    # Looked up per reduced object of a non-builtin type, so registrations made later
    # (init_reductions(), user reducers) apply at once.
    dispatch_table = ChainMap(
        ForkingPickler._extra_reducers,  # type: ignore[attr-defined]  # private, stable
        copyreg.dispatch_table,  # type: ignore[arg-type]
    )


class _SharedPickler:
    """One pickler reused by every thread, taken with a non-blocking lock: a thread (or a
    reducer re-entering ``dumps``) that finds it busy pickles with a fresh one instead."""

    def __init__(self) -> None:
        self.chunks: List[bytes] = []
        self.pickler = _QueuePickler(_Sink(self.chunks.append), PROTOCOL)
        self.lock = threading.Lock()


_shared = _SharedPickler()
_BY_REFERENCE_ERRORS = _byvalue.BY_REFERENCE_ERRORS
_modules = sys.modules
_main_ok: Any = None  # a __main__ children can import, once seen (_by_value_main)


def _reset_after_fork() -> None:  # another thread may have held the lock at fork time
    global _shared
    _shared = _SharedPickler()


os.register_at_fork(after_in_child=_reset_after_fork)


def dumps(obj: Any) -> bytes:
    """``ForkingPickler.dumps(obj, 5)``, as bytes (Note [Pickling queue items])."""
    return dump_item(obj, sys.maxsize)  # type: ignore[no-any-return]  # joined: no limit


def dump_item(obj: Any, limit: int) -> Any:
    """``dumps(obj)``, except that a pickle larger than ``limit`` made of several chunks comes
    back as the list of chunks, not joined: :func:`to_block` copies them once (Note [Large
    items out of line]). Objects that cannot be pickled by reference are pickled by value
    (Note [By-value fallback] in ``byvalue.py``)."""
    tp = type(obj)
    if tp in PLAIN_TYPES:  # a plain value, or a small tuple of them: no reducer can apply
        return _plain_dumps(obj, PROTOCOL)
    if tp is tuple and len(obj) <= 8:
        for x in obj:
            if type(x) not in PLAIN_TYPES and not _plain_part(x):
                break
        else:
            return _plain_dumps(obj, PROTOCOL)
    shared = _shared
    try:
        if not shared.lock.acquire(False):
            parts: List[Any] = []
            _QueuePickler(_Sink(parts.append), PROTOCOL).dump(obj)
            data = None
        else:
            chunks = shared.chunks
            try:
                shared.pickler.dump(obj)
                if len(chunks) == 1:
                    data = chunks[0]
                else:
                    data, parts = None, chunks[:]
            finally:
                chunks.clear()
                shared.pickler.clear_memo()
                shared.lock.release()
    except _BY_REFERENCE_ERRORS as exc:  # Note [By-value fallback] (byvalue.py)
        return _byvalue.by_value(obj, exc)
    if data is None:
        if len(parts) == 1:
            data = parts[0]
        elif sum(len(p) for p in parts) <= limit:
            data = b"".join(parts)
        else:
            data = parts
    if _modules.get("__main__") is not _main_ok:  # one dict lookup while __main__ is fine
        again = _by_value_main(obj, data)
        if again is not None:
            return again
    return data


def _plain_part(x: Any) -> bool:
    """Whether ``x``, inside a small tuple, needs no reducer either: small bytes, or a small
    tuple of plain values and small bytes (a task message carrying a wire value)."""
    tp = type(x)
    if tp is bytes:
        return len(x) <= PLAIN_BYTES
    if tp is not tuple or len(x) > 8:
        return False
    for y in x:
        ty = type(y)
        if ty not in PLAIN_TYPES and (ty is not bytes or len(y) > PLAIN_BYTES):
            return False
    return True


def _by_value_main(obj: Any, data: Any) -> bytes | None:
    """Case 2 of Note [By-value fallback]: ``obj`` pickled by value if its plain pickle
    ``data`` names a ``__main__`` that children cannot import (``data``'s references are
    then released), else None. Remembers a ``__main__`` children can import."""
    global _main_ok
    if _byvalue.main_is_importable():
        _main_ok = _modules.get("__main__")
        return None
    if not _byvalue.names_main(data):
        return None
    again = _byvalue.by_value(obj)
    if again is not None:
        release_frame(TAG_PICKLE, data if type(data) is bytes else b"".join(data))
    return again


def _named() -> bool:
    return get_sharing_strategy() == "file_system"


def to_block(tag: int, parts: Any) -> bytes:
    """Copies ``parts`` (the frame payload of tag ``tag``) into a new arena block; returns
    the ``TAG_BLOCK`` payload naming it (Note [Large items out of line])."""
    nbytes = sum(len(p) for p in parts)
    block = _C.allocate(max(nbytes, 1), _named())
    view = memoryview(block)
    try:
        at = 0
        for part in parts:
            n = len(part)
            if type(part) is bytes:
                ctypes.memmove(block.address + at, part, n)  # without the GIL
            else:
                view[at:at + n] = memoryview(part).cast("B")
            at += n
    finally:
        view.release()
    handle = block.share()
    del block  # the handle's reference is the frame's
    return _plain_dumps((tag, handle, nbytes), PROTOCOL)


def _from_block(data: bytes, use: Callable[[int, memoryview], Any]) -> Any:
    tag, handle, nbytes = loads(data)
    try:
        block = _C.attach(handle)
    except OSError as exc:
        raise PeerDiedError(
            f"a queue item of {nbytes} bytes, stored out of line by process {handle[6]}, is "
            f"lost: its memory could not be mapped ({exc}). The process that put it most "
            f"likely was killed before this one received it (Note [Large items out of line]); "
            f"the queue itself goes on. Keep producers alive until their items are received, "
            f"or use set_sharing_strategy('file_system')") from exc
    view = memoryview(block)[:nbytes]
    try:
        return use(tag, view)
    finally:
        view.release()
        del block


def _decode_view(tag: int, view: memoryview) -> Any:
    if tag == TAG_BYTES:
        return view.tobytes()
    return loads(view)


def decode(tag: int, data: bytes) -> Any:
    """The item a frame holds."""
    if tag == TAG_PICKLE:
        return loads(data)
    if tag == TAG_BYTES:
        return data
    if tag == TAG_RECORD:
        return _records.rebuild(data)
    if tag == TAG_BLOCK:
        return _from_block(data, _decode_view)
    raise ValueError(f"unknown queue frame tag {tag}: was it written by another version?")


# ---- dropping frames (Note [Releasing dropped frames]) ------------------------------------


class Inert:
    """Stands in for every class and function a dropped frame names."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Inert:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Inert:
        return Inert()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def add(self, item: Any) -> None:
        pass


def _drop_storage(cls: Any, handle: tuple, offset: int, nbytes: int) -> None:
    _C.release_handle(handle)


def _drop_handle_first(handle: tuple, *rest: Any) -> None:
    _C.release_handle(handle)


# Every rebuild function that takes over a block reference (reductions.py, data/).
DROPPERS = {
    ("torch_mp_ext.reductions", "rebuild_storage"): _drop_storage,
    ("torch_mp_ext.reductions", "rebuild_cpu_tensor"): _drop_handle_first,
    ("torch_mp_ext.reductions", "rebuild_array"): _drop_handle_first,
    ("torch_mp_ext.data.containers", "rebuild_shared"): _drop_handle_first,
    ("torch_mp_ext.exchange.channel", "_rebuild"): _drop_handle_first,
}


class _Releaser(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return DROPPERS.get((module, name), Inert)


def _release_view(tag: int, view: memoryview) -> None:
    if tag == TAG_PICKLE:
        _Releaser(io.BytesIO(view)).load()


def release_pickle(data: Any) -> None:
    """Drops the references a pickle nobody will load holds; never raises."""
    try:
        _Releaser(io.BytesIO(data)).load()
    except Exception:  # a pickle we cannot walk: its references stay, as after a crash
        log.debug("could not release the references of a pickle never loaded", exc_info=True)


def release_frame(tag: int, data: bytes) -> None:
    """Drops the references a frame nobody will take holds; never raises."""
    if tag not in (TAG_PICKLE, TAG_BLOCK, TAG_RECORD):
        return
    try:
        if tag == TAG_RECORD:
            _records.release(data)
        elif tag == TAG_BLOCK:
            _from_block(data, _release_view)
        else:
            _Releaser(io.BytesIO(data)).load()
    except Exception:  # a frame we cannot walk: its references stay, as after a crash
        log.debug("could not release the references of a dropped queue item", exc_info=True)
