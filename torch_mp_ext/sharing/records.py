"""Plain CPU tensors on arena blocks as flat records (Note [Lean tensor records] in
``csrc/shm/record.h``: the layout, and why).

Note [Which tensors take records]
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
from .. import torch_internals as _ti
from ..errors import CorruptSegmentError
from . import memory as _memory

__all__ = ["shared_cache", "share_tensor", "share_tensor_deferred", "remember_sent",
           "share_array", "rebuild", "release", "check_aligned", "check_storage_aligned"]

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
_ALIGN = [min(n, 16) for n in _ITEMSIZE]  # _check_address's rule, per code (hot path)
_STRIDED = torch.strided

#: numpy dtypes a record carries (native byte order, no objects): the position in this list.
_NP_DTYPES = [np.dtype(c) for c in "?bBhHiIlLqQefdg"]
_NP_CODES = {d: i for i, d in enumerate(_NP_DTYPES)}

KIND_TENSOR = 0
KIND_ARRAY = 1
REQUIRES_GRAD = 1  # tensors
DENSE = 2  # tensors: contiguous from the storage's first byte to its last: frombuffer + view
READONLY = 4  # arrays: not writeable


class _StorageRef(StorageWeakRef):
    """torch's ``StorageWeakRef`` without its per-object lookups of ``torch.Storage`` (a
    third of its cost, made per hand-off on each side): the same fields, so torch's code and
    ``SharedCache`` use it unchanged."""

    __slots__ = ()

    def __init__(self, storage: torch.UntypedStorage) -> None:  # not calling super(): its cost
        self.cdata = storage._weak_ref()
        self._free_weak_ref = _FREE_WEAK_REF


_FREE_WEAK_REF = _ti.free_weak_ref  # what TypedStorage's classmethod calls


def _record(t: torch.Tensor, code: int, s: torch.UntypedStorage, nbytes: int,
            flags: int) -> Optional[tuple]:
    # The C++ side sets DENSE from the shape (one call instead of three here).
    return _C.share_record(s.data_ptr(), nbytes, t.storage_offset(), t.size(), t.stride(),
                           code, KIND_TENSOR, flags, _ITEMSIZE[code])


def share_tensor(t: torch.Tensor) -> Optional[bytes]:
    """The record of ``t`` (moving its storage into the arena first if needed), or None
    when ``t`` must be pickled instead. The caller checked ``type(t) is torch.Tensor``."""
    got = share_tensor_deferred(t)
    if got is None:
        return None
    data, key, storage = got
    remember_sent(key, storage)
    return data


def share_tensor_deferred(t: torch.Tensor) -> Optional[tuple]:
    """``share_tensor`` without its bookkeeping: (record, key, storage), for which the caller
    calls :func:`remember_sent` once the record is on its way (Note [Sent storages later])."""
    code = _CODES.get(t.dtype)
    if code is None or t.layout is not _STRIDED or not t.is_cpu:
        return None
    flags = 0
    if t.requires_grad:
        if not t.is_leaf:
            return None  # the pickler raises torch's error for it
        flags = REQUIRES_GRAD
    s = t.untyped_storage()
    nbytes = s.nbytes()
    if nbytes == 0:
        return None
    got = _record(t, code, s, nbytes, flags)
    if got is None:
        if s.is_shared():  # torch's own shared memory keeps torch's handles
            return None
        _memory.move_storage_(s)  # Note [Moving storages in place]
        got = _record(t, code, s, nbytes, flags)
        if got is None:
            return None
    return got[0], got[1], s


def remember_sent(key: tuple, storage: torch.UntypedStorage) -> None:
    """Note [Sent storages later]: enters a sent storage in ``shared_cache``.

    Note [Sent storages later]
    A sender enters each storage it shares in ``shared_cache``, as torch's reducers do, so
    that the tensor coming back rebuilds onto the same storage. ``Queue.put`` does it after
    the frame is in the ring, not before: the receiver, woken at once, rebuilds while the
    sender does its bookkeeping instead of after it (a weak reference and a dict store: a
    few microseconds of a hand-off on cold caches). Until then a record of that block
    arriving in another thread of the sender misses the cache and makes a second storage on
    the same memory, as torch does on any miss; the data is the same."""
    shared_cache[key] = _StorageRef(storage)


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
    _check_address(t.dtype, t.data_ptr())
    return t


def check_storage_aligned(storage: Any, dtype: torch.dtype) -> None:
    """CorruptSegmentError if a CPU ``storage`` does not start aligned for ``dtype``
    (:func:`check_aligned` for typed storages, which have no tensor to check)."""
    if storage.device.type == "cpu":
        _check_address(dtype, storage.data_ptr())


def _rebuild_array(block: _C.Block, code: int, flags: int, offset: int, so: int,
                   sizes: tuple, strides: tuple) -> np.ndarray:
    arr = _memory.array_from_block(block, offset + so, sizes, _NP_DTYPES[code], strides)
    if flags & READONLY:
        arr.flags.writeable = False
    return arr


def _check_address(dtype: torch.dtype, address: int) -> None:
    """The one alignment rule: data of ``dtype`` starts on a multiple of its item size, up
    to 16 (c10::complex<double> is alignas(16)); else CorruptSegmentError."""
    align = min(dtype.itemsize, 16)
    if address % align:
        raise CorruptSegmentError(
            f"a shared tensor handle places a {dtype} tensor at address {address:#x}, which "
            f"is not {align}-byte aligned: the handle was forged or corrupted")


def rebuild(data: bytes) -> Any:
    """The tensor or array of a record, viewing its block (zero-copy); takes over its
    reference (a failure drops it)."""
    key, kind, code, flags, offset, nbytes, so, sizes, strides, address, block = \
        _C.take_record(data)
    if kind == KIND_ARRAY and code < len(_NP_DTYPES):
        return _rebuild_array(block, code, flags, offset, so, sizes, strides)
    if kind != KIND_TENSOR or code >= len(_DTYPES):
        del block  # dropped now, not kept alive by the traceback
        what = "array" if kind == KIND_ARRAY else "tensor"
        raise CorruptSegmentError(f"a queue item holds a shared {what} record of kind {kind} "
                                  f"and dtype code {code}, which this version cannot read")
    dtype = _DTYPES[code]
    ref = shared_cache.get(key)
    storage = None if ref is None else _ti.new_with_weak_ptr(ref.cdata)
    if storage is not None:  # Note [Identity of rebuilt storages]: already here
        del block  # the reference the record carried
        t = check_aligned(torch.empty((0,), dtype=dtype).set_(storage, so, sizes, strides))
    else:
        # The rule on the address the view will have (a forged offset raises before any
        # tensor exists); torch checks the extent against the block.
        if (address + so * _ITEMSIZE[code]) % _ALIGN[code]:
            del block
            _check_address(dtype, address + so * _ITEMSIZE[code])
        try:
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
        shared_cache[key] = _StorageRef(t.untyped_storage())
    if flags & REQUIRES_GRAD:
        t.requires_grad_(True)
    return t


def release(data: bytes) -> None:
    """Drops the reference of a record nobody will rebuild."""
    _C.release_record(data)
