"""Plain CPU tensors on arena blocks as flat records (Note [Lean tensor records]).

Note [Lean tensor records]
A queue item that is exactly one ``torch.Tensor`` (not a subclass, not a Parameter) with a
real dtype, strided, on the CPU and not a non-leaf of autograd, crosses as a fixed-layout
record (``csrc/shm/record.h``) in a frame of its own tag, built by one C++ call on each side
instead of the pickler's reduce/rebuild round (about 17 us of the 45 us a 4 KB hand-off
took). Everything else, a tensor inside a tuple included, is pickled as before, and a record
rebuilds exactly the tensor ``rebuild_cpu_tensor`` would: the same storage identity (the
``shared_cache`` below is ``reductions.shared_cache``), views, ``requires_grad``.

The record carries one counted reference (Note [Block lifetime]): ``rebuild`` takes it over
or gives it back; ``release`` drops it for a frame nobody will take.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch.multiprocessing.reductions import SharedCache, StorageWeakRef

from .. import _C
from ..errors import CorruptSegmentError
from . import memory as _memory

__all__ = ["shared_cache", "share_tensor", "share_array", "rebuild", "release", "check_aligned"]

class _Cache(SharedCache):
    """torch's ``SharedCache`` with a lock only around its sweep: a locked ``get`` and
    ``__setitem__`` were a third of a record's cost, and single dict operations are atomic
    under the GIL. A sweep racing an unlocked store can drop that fresh entry; the next
    rebuild of its block then makes a second storage on the same memory, as torch does when
    its cache misses."""

    get = dict.get  # type: ignore[assignment]

    def __setitem__(self, key: object, storage_ref: StorageWeakRef) -> None:
        dict.__setitem__(self, key, storage_ref)
        if len(self) > self.limit:
            with self.lock:
                self.free_dead_references()


shared_cache = _Cache()
"""Storages rebuilt or sent by this process, by block key (``reductions.shared_cache``):
Note [Identity of rebuilt storages] in ``reductions.py``."""

#: Codes on the wire: the position in this list. Complex dtypes (conj/neg bits) and
#: quantized ones stay with the pickler.
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8,
           torch.int8, torch.int16, torch.int32, torch.int64, torch.bool]
_DTYPES += [d for d in (getattr(torch, n, None) for n in ("uint16", "uint32", "uint64"))
            if d is not None]
_CODES = {d: i for i, d in enumerate(_DTYPES)}
_ITEMSIZE = [torch.empty((), dtype=d).element_size() for d in _DTYPES]

#: numpy dtypes a record carries (native byte order, no objects): the position in this list.
_NP_DTYPES = [np.dtype(c) for c in "?bBhHiIlLqQefdg"]
_NP_CODES = {d: i for i, d in enumerate(_NP_DTYPES)}

KIND_TENSOR = 0
KIND_ARRAY = 1
REQUIRES_GRAD = 1  # tensors
DENSE = 2  # tensors: contiguous from the storage's first byte to its last: frombuffer + view
READONLY = 4  # arrays: not writeable


def _record(t: torch.Tensor, code: int, s: torch.UntypedStorage, nbytes: int) -> Optional[tuple]:
    flags = 0
    if t.requires_grad:
        flags = REQUIRES_GRAD
    if t.storage_offset() == 0 and t.numel() * _ITEMSIZE[code] == nbytes and t.is_contiguous():
        flags |= DENSE
    return _C.share_record(s.data_ptr(), nbytes, t.storage_offset(), t.size(), t.stride(),
                           code, KIND_TENSOR, flags)


def share_tensor(t: torch.Tensor) -> Optional[bytes]:
    """The record of ``t`` (moving its storage into the arena first if needed), or None
    when ``t`` must be pickled instead. The caller checked ``type(t) is torch.Tensor``."""
    code = _CODES.get(t.dtype)
    if code is None or t.layout is not torch.strided or not t.is_cpu:
        return None
    if t.requires_grad and not t.is_leaf:
        return None  # the pickler raises torch's error for it
    s = t.untyped_storage()
    nbytes = s.nbytes()
    if nbytes == 0:
        return None
    got = _record(t, code, s, nbytes)
    if got is None:
        if s.is_shared():  # torch's own shared memory keeps torch's handles
            return None
        _memory.move_storage_(s)  # Note [Moving storages in place]
        got = _record(t, code, s, nbytes)
        if got is None:
            return None
    data, key = got
    shared_cache[key] = StorageWeakRef(s)
    return data


def share_array(arr: np.ndarray) -> Optional[bytes]:
    """The record of an array whose memory lies in a block of this process, or None (then
    it is pickled: copied into a block if large). The caller checked ``type(arr)``."""
    code = _NP_CODES.get(arr.dtype)
    if code is None or arr.size == 0:
        return None
    low, span = _memory.extent(arr)
    got = _C.share_record(arr.__array_interface__["data"][0] + low, span, -low, arr.shape,
                          arr.strides, code, KIND_ARRAY,
                          0 if arr.flags.writeable else READONLY)
    return None if got is None else got[0]


def check_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or CorruptSegmentError if its data is not aligned for its dtype: a forged
    offset put a complex128 tensor at an odd address and torch's own kernels then died of
    SIGSEGV writing it (c10::complex<double> is alignas(16); found by the long fuzz run).
    Storages we share start on block boundaries, so only a forged handle or record fails."""
    align = min(t.element_size(), 16)
    if align > 1 and t.data_ptr() % align:
        raise CorruptSegmentError(
            f"a shared tensor handle places a {t.dtype} tensor at address {t.data_ptr():#x}, "
            f"which is not {align}-byte aligned: the handle was forged or corrupted")
    return t


def _rebuild_array(data: bytes, code: int, flags: int, offset: int, so: int, sizes: tuple,
                   strides: tuple) -> np.ndarray:
    if code >= len(_NP_DTYPES):
        _C.release_record(data)
        raise CorruptSegmentError(f"a queue item holds a shared array record of dtype code "
                                  f"{code}, which this version cannot read")
    arr = _memory.array_from_block(_C.attach_record(data), offset + so, sizes,
                                   _NP_DTYPES[code], strides)
    if flags & READONLY:
        arr.flags.writeable = False
    return arr


def rebuild(data: bytes) -> Any:
    """The tensor or array of a record, viewing its block (zero-copy); takes over its
    reference."""
    key, kind, code, flags, offset, nbytes, so, sizes, strides, _ = _C.read_record(data)
    if kind == KIND_ARRAY:
        return _rebuild_array(data, code, flags, offset, so, sizes, strides)
    if kind != KIND_TENSOR or code >= len(_DTYPES):
        _C.release_record(data)
        raise CorruptSegmentError(f"a queue item holds a shared tensor record of kind {kind} "
                                  f"and dtype code {code}, which this version cannot read")
    dtype = _DTYPES[code]
    ref = shared_cache.get(key)
    storage = None if ref is None else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
    if storage is not None:  # Note [Identity of rebuilt storages]: already here
        _C.release_record(data)
        t = torch.empty((0,), dtype=dtype).set_(storage, so, sizes, strides)
    else:
        block = _C.attach_record(data)
        try:  # torch checks the extent against the block (a forged one raises here)
            if flags & DENSE:
                t = torch.frombuffer(block, dtype=dtype, count=nbytes // _ITEMSIZE[code],
                                     offset=offset)
                if len(sizes) != 1:
                    t = t.view(sizes)
            else:
                storage = _memory.storage_from_block(block, offset, nbytes)
                t = torch.empty((0,), dtype=dtype).set_(storage, so, sizes, strides)
        finally:
            del block  # not kept alive by a traceback: the tensor holds what it needs
        shared_cache[key] = StorageWeakRef(t.untyped_storage())
    check_aligned(t)
    if flags & REQUIRES_GRAD:
        t.requires_grad_(True)
    return t


def release(data: bytes) -> None:
    """Drops the reference of a record nobody will rebuild."""
    _C.release_record(data)
