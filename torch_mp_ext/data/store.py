"""Python objects serialized once into one shared-memory block, and read back one at a time.

Note [Store layout]
A store is one arena block (so it pickles as one handle of a few dozen bytes, whatever its
size), written once by the process that builds it and read-only after that:

    ┌ header (128 B) ┬ offsets: uint64[R + 1] ┬ dict only: hashes: uint32[n] ┬ table ─┬ data ┐

``R`` records: a list of ``n`` items has ``R = n`` (record i is item i); a dict of ``n``
entries has ``R = 2n`` (record j is key j, record n + j its value; insertion order). Record r
is the bytes ``data[offsets[r]:offsets[r + 1]]``; its first byte names its codec:

- ``M``: ``marshal`` of an item made only of ``None``, ``bool``, ``int``, ``float``,
  ``complex``, ``str``, ``bytes`` and ``tuple``/``list``/``dict``/``set``/``frozenset`` of
  those, exact types (Note [Why marshal]);
- ``P``: a protocol-5 pickle (anything else picklable);
- ``B``: a protocol-5 pickle whose numpy arrays and CPU tensors were written out of band:
  ``u32 k, u64 pickle length, k x (u64 data offset, u64 nbytes, u8 writable)``, the pickle,
  then the k buffers, each 64-byte aligned. Reading passes views of the block as the
  buffers, so such arrays and tensors are zero-copy views of the store.

A dict adds ``hashes[j]`` (``hashing.stable_hash`` of key j) and an open-addressing table of
``slots`` (a power of two, at least twice n) entries, each 0 (empty) or ``j + 1``, probed
linearly from ``hash & (slots - 1)``. The hash is stable across processes (``hash()`` of a
``str`` is not: spawn children get another ``PYTHONHASHSEED``), and consistent with ``==``
for the key types a store accepts (``1``, ``1.0`` and ``True`` hash alike, as in a dict).

Note [Reading touches no shared page]
Reading record r slices a ``memoryview`` of the block and deserializes the slice: the new
objects live in the reader's private heap and die with it; the store's bytes are only read,
so a forked worker shares every page of them with its parent for good, where reading a
Python list writes the reference count of every item it touches and so copies its pages
(pytorch/pytorch#13246). What each process holds privately is the handful of objects of the
store itself (a block reference, a few memoryviews).

Note [Freeing a store]
The store's block is counted like any arena block (Note [Block lifetime] in
``csrc/shm/layout.h``): every process holding it, and every handle in flight, holds a
reference, and the last one to let go frees it, a worker killed by SIGKILL included (its
references are reclaimed as a dead holder's). A freed block goes back to its owner's pool,
where the arena keeps free segments for reuse up to its cache limit (1 GiB by default): right
for the batches of a loader, which come back every few milliseconds, wrong for a store of
hundreds of MiB that was built once. So when the building process's last reference to a
store of ``RELEASE_AT_ONCE_BYTES`` or more dies (the ``Block`` object: the store and every
array or tensor viewing it), it calls ``empty_cache()``, which returns every fully free
segment it owns to the OS at once. If workers still hold the store then, it is freed when the
last of them lets go, and stays in the owner's pool until the cache is trimmed or emptied.

Note [Why marshal]
For the plain records datasets are made of (paths, labels, boxes), ``marshal`` writes and
reads about twice as fast as pickle and needs no per-item header. It is only used on items
checked to be made of exact builtin types (:func:`_plain`): marshal writes any other object
with the buffer protocol (a numpy array or scalar, a ``bytearray``) as ``bytes``, and would
change its type. Every process of a run uses the same interpreter, so its marshal format.
"""

from __future__ import annotations

import io
import marshal
import pickle
import struct
import sys
import time
import weakref
from array import array
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import torch

from .. import _C
from ..errors import CorruptSegmentError
from ..sharing import memory as _memory
from .hashing import open_table, stable_hash

__all__ = ["Store", "build_list", "build_dict", "attach", "KIND_LIST", "KIND_DICT"]

KIND_LIST, KIND_DICT = 0, 1
_MAGIC = b"TMXSTORE"
_VERSION = 1
# magic, version, kind, records, offsets, hashes, table, table slots, table itemsize, data
_HEADER = struct.Struct("<8sIIQQQQQQQ")
_HEADER_BYTES = 128
_ALIGN = 64  # records' out-of-band buffers; blocks are 64-byte aligned (BLOCK_ALIGNMENT)

_MARSHAL, _PICKLE, _BUFFERS = 0x4D, 0x50, 0x42  # "M", "P", "B"
_OOB_HEAD = struct.Struct("<IQ")
_OOB_DESC = struct.Struct("<QQB")
_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes})
_MAX_DEPTH = 64

#: Stores of at least this many items print their progress on a terminal (stderr a TTY).
PROGRESS_MIN_ITEMS = 200_000
#: Stores of at least this many bytes are returned to the OS when the building process lets
#: go of them (Note [Freeing a store]).
RELEASE_AT_ONCE_BYTES = 16 << 20


def _plain(obj: Any, depth: int = 0) -> bool:
    """True if ``obj`` is made only of exact builtin types marshal keeps (Note [Why marshal])."""
    t = type(obj)
    if t in _PLAIN:
        return True
    if depth > _MAX_DEPTH:
        return False
    if t is list or t is tuple or t is set or t is frozenset:
        for x in obj:
            if type(x) not in _PLAIN and not _plain(x, depth + 1):
                return False
        return True
    if t is dict:
        for k, v in obj.items():
            if type(k) not in _PLAIN and not _plain(k, depth + 1):
                return False
            if type(v) not in _PLAIN and not _plain(v, depth + 1):
                return False
        return True
    return False


def _rebuild_tensor(buf: memoryview, dtype: torch.dtype, shape: tuple,
                    requires_grad: bool) -> torch.Tensor:
    """A tensor viewing an out-of-band buffer of a store (zero-copy; keeps the block alive)."""
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype, requires_grad=requires_grad)
    t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
    return t.requires_grad_(requires_grad) if requires_grad else t


class _Pickler(pickle.Pickler):
    """Protocol 5 with plain CPU tensors out of band, as their raw bytes (torch's own reduce
    never emits a ``PickleBuffer``); numpy arrays go out of band by themselves."""

    def __init__(self, file: io.BytesIO, buffers: list, writable: set) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self._writable = writable

    def reducer_override(self, obj: Any) -> Any:
        if (type(obj) is not torch.Tensor or obj.device.type != "cpu"
                or obj.layout != torch.strided or obj.is_quantized):
            return NotImplemented
        raw = obj.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
        buf = pickle.PickleBuffer(raw.view(torch.uint8).numpy())
        self._writable.add(id(buf))
        return (_rebuild_tensor, (buf, obj.dtype, tuple(obj.shape), obj.requires_grad))


def _pad(data: bytearray) -> None:
    data += bytes(-len(data) % _ALIGN)


def _append(data: bytearray, item: Any) -> None:
    """Appends one record of ``item`` to ``data`` (Note [Store layout])."""
    if _plain(item):
        try:
            encoded = marshal.dumps(item)
        except ValueError:  # nested deeper than marshal goes
            pass
        else:
            data.append(_MARSHAL)
            data += encoded
            return
    buffers: list = []
    writable: set = set()
    f = io.BytesIO()
    _Pickler(f, buffers, writable).dump(item)
    pickled = f.getbuffer()
    if not buffers:
        data.append(_PICKLE)
        data += pickled
        return
    data.append(_BUFFERS)
    data += _OOB_HEAD.pack(len(buffers), len(pickled))
    desc_at = len(data)
    data += bytes(_OOB_DESC.size * len(buffers))
    data += pickled
    for i, pb in enumerate(buffers):
        raw = pb.raw()  # C- or F-contiguous: what numpy and _Pickler hand out of band
        _pad(data)
        _OOB_DESC.pack_into(data, desc_at + i * _OOB_DESC.size, len(data), raw.nbytes,
                            id(pb) in writable)
        data += raw


class _Progress:
    """``\\r``-updated progress on stderr, for big stores built on a terminal."""

    def __init__(self, total: Optional[int], enabled: Optional[bool], what: str) -> None:
        if enabled is None:
            enabled = total is not None and total >= PROGRESS_MIN_ITEMS and sys.stderr.isatty()
        self.enabled, self.total, self.what = enabled, total, what
        self.t0 = self.last = time.monotonic()

    def update(self, done: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < 0.2):
            return
        self.last = now
        of = f"/{self.total:,} ({100 * done // max(self.total, 1)}%)" if self.total else ""
        sys.stderr.write(f"\rsharing {self.what}: {done:,}{of} items, {now - self.t0:.1f} s")
        if force:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _fill(data: bytearray, offsets: array, items: Iterable, progress: _Progress,
          what: str, done_before: int = 0) -> int:
    """Appends a record per item; returns how many (Note [Store layout])."""
    append, add = offsets.append, _append
    count = 0
    for count, item in enumerate(items, 1):
        try:
            add(data, item)
        except (MemoryError, OSError):
            raise  # out of memory is not the item's fault
        except Exception as exc:  # pickle raises many kinds: name the item, keep the cause
            raise TypeError(
                f"cannot store {what} {count - 1} (of type {type(item).__module__}."
                f"{type(item).__qualname__}) in shared memory: {exc}. Items must be "
                "picklable; convert this one to a picklable type (or keep it out of the "
                "shared store)") from exc
        append(len(data))
        if not count & 0x1FFF:
            progress.update(done_before + count)
    return count


def _write(kind: int, records: int, offsets: array, data: bytearray,
           hashes: Optional[np.ndarray], table: Optional[np.ndarray]) -> Store:
    """Copies a built store into one new block (Note [Store layout])."""
    pos = _HEADER_BYTES
    offsets_at = pos
    pos += 8 * (records + 1)
    hashes_at = table_at = slots = itemsize = 0
    if hashes is not None and table is not None:
        hashes_at = pos
        pos += hashes.nbytes
        pos += -pos % 8
        table_at, slots, itemsize = pos, len(table), table.itemsize
        pos += table.nbytes
    data_at = pos + (-pos % _ALIGN)
    block = _memory.allocate(data_at + len(data))
    mv = memoryview(block)
    mv[:_HEADER.size] = _HEADER.pack(_MAGIC, _VERSION, kind, records, offsets_at, hashes_at,
                                     table_at, slots, itemsize, data_at)
    mv[offsets_at:offsets_at + 8 * (records + 1)] = memoryview(offsets).cast("B")
    if hashes is not None and table is not None:
        mv[hashes_at:hashes_at + hashes.nbytes] = hashes.tobytes()
        mv[table_at:table_at + table.nbytes] = table.tobytes()
    mv[data_at:data_at + len(data)] = data
    mv.release()
    if block.capacity >= RELEASE_AT_ONCE_BYTES:  # Note [Freeing a store]
        weakref.finalize(block, _C.empty_cache).atexit = False
    return Store(block)


def build_list(items: Iterable, progress: Optional[bool] = None) -> Store:
    """A store of ``items`` in order (one pass; ``items`` may be a generator).

    Raises:
        TypeError: an item cannot be pickled (the message names its index and type).
    """
    total = len(items) if hasattr(items, "__len__") else None  # type: ignore[arg-type]
    bar = _Progress(total, progress, "list")
    data, offsets = bytearray(), array("Q", [0])
    n = _fill(data, offsets, items, bar, "item")
    bar.update(n, force=True)
    return _write(KIND_LIST, n, offsets, data, None, None)


def build_dict(mapping: Any, progress: Optional[bool] = None) -> Store:
    """A store of a mapping's entries in its order (keys: ``hashing.stable_hash``'s types).

    Raises:
        TypeError: a key of another type, or a key or value that cannot be pickled.
    """
    bar = _Progress(len(mapping) * 2, progress, "dict")
    data, offsets = bytearray(), array("Q", [0])
    keys = list(mapping.keys())
    hashes = np.empty(len(keys), dtype=np.uint32)
    for j, key in enumerate(keys):
        try:
            hashes[j] = stable_hash(key)
        except TypeError as exc:
            raise TypeError(f"cannot store key {j} (of type {type(key).__module__}."
                            f"{type(key).__qualname__}) in a SharedDict: {exc}") from exc
    n = _fill(data, offsets, keys, bar, "key")
    _fill(data, offsets, (mapping[k] for k in keys), bar, "the value of entry", n)
    del keys
    bar.update(2 * n, force=True)
    return _write(KIND_DICT, 2 * n, offsets, data, hashes, open_table(hashes))


class Store:
    """A built store's block, read back record by record (Note [Store layout]).

    Args:
        block: the block holding the store (a reference this object keeps).

    Raises:
        CorruptSegmentError: the block does not hold a store of this version.
    """

    __slots__ = ("block", "kind", "records", "_buf", "_ro", "_off", "_hashes", "_table",
                 "_mask", "_data_at")
    _hashes: Optional[memoryview]
    _table: Optional[memoryview]

    def __init__(self, block: Any) -> None:
        self.block = block
        buf = memoryview(block)
        (magic, version, kind, records, offsets_at, hashes_at, table_at, slots, itemsize,
         data_at) = _HEADER.unpack_from(buf, 0)
        if magic != _MAGIC or version != _VERSION or kind not in (KIND_LIST, KIND_DICT):
            raise CorruptSegmentError(
                f"shared-memory block {block.segment_id:#x}/{block.index} does not hold a "
                f"torch_mp_ext store of layout {_VERSION} (magic {magic!r}, version "
                f"{version}): the handle is stale or from another build of torch_mp_ext")
        self.kind, self.records, self._data_at = kind, records, data_at
        self._buf = buf
        self._ro = buf.toreadonly()
        self._off = buf[offsets_at:offsets_at + 8 * (records + 1)].cast("Q")
        self._hashes = self._table = None
        self._mask = 0
        if kind == KIND_DICT:
            n = records // 2
            self._hashes = buf[hashes_at:hashes_at + 4 * n].cast("I")
            self._table = buf[table_at:table_at + slots * itemsize].cast(
                "I" if itemsize == 4 else "Q")
            self._mask = slots - 1

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory the store's block spans."""
        return self.block.capacity

    def share(self) -> tuple:
        """A handle of the block carrying one new reference (for a pickle in flight)."""
        return self.block.share()

    def record(self, r: int) -> Any:
        """Deserializes record ``r`` (``0 <= r < records``; not checked here)."""
        off = self._off
        a = off[r] + self._data_at
        b = off[r + 1] + self._data_at
        buf = self._buf
        codec = buf[a]
        if codec == _MARSHAL:
            return marshal.loads(buf[a + 1:b])
        if codec == _PICKLE:
            return pickle.loads(buf[a + 1:b])
        if codec == _BUFFERS:
            return self._with_buffers(a, b)
        raise CorruptSegmentError(f"record {r} of a shared store has unknown codec {codec}: "
                                  "the store's memory was overwritten")

    def _with_buffers(self, a: int, b: int) -> Any:
        buf, ro, at = self._buf, self._ro, self._data_at
        k, plen = _OOB_HEAD.unpack_from(buf, a + 1)
        desc = a + 1 + _OOB_HEAD.size
        views = []
        for i in range(k):
            offset, nbytes, writable = _OOB_DESC.unpack_from(buf, desc + i * _OOB_DESC.size)
            views.append((buf if writable else ro)[at + offset:at + offset + nbytes])
        start = desc + k * _OOB_DESC.size
        return pickle.loads(buf[start:start + plen], buffers=views)

    def records_from(self, start: int, stop: int) -> Iterator[Any]:
        """Records ``start`` to ``stop - 1`` in order."""
        record = self.record
        for r in range(start, stop):
            yield record(r)

    def find(self, key: Any) -> int:
        """The entry index of ``key`` in a dict store, or -1.

        Raises:
            TypeError: ``key`` is unhashable.
        """
        hash(key)  # unhashable keys raise TypeError, as a dict's lookup does
        try:
            h = stable_hash(key)
        except TypeError:
            return -1  # a key of another type is never stored (build_dict refuses them)
        table, hashes, mask, record = self._table, self._hashes, self._mask, self.record
        if table is None or hashes is None:
            raise TypeError("find() is for a store built from a mapping")
        pos = h & mask
        while True:
            j = table[pos]
            if j == 0:
                return -1
            j -= 1
            if hashes[j] == h and record(j) == key:
                return j
            pos = (pos + 1) & mask


def attach(handle: tuple) -> Store:
    """The store a handle names, taking over the handle's reference."""
    return Store(_C.attach(handle))

