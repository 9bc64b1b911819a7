"""Storages and arrays over shared-memory blocks: the torch/numpy side of the arena.

Note [Moving storages in place]
A CPU storage that is not in shared memory yet is moved, like torch's ``share_memory_()``:
its bytes are copied once into a new block and the storage's data pointer is swapped
(``UntypedStorage._swap_data_ptr_``), so every tensor viewing that storage, in the sender
too, now lives in the block. Writes by receivers are then visible to the sender, as in torch.
The swapped-in storage is not resizable: ``resize_()`` raises ``RuntimeError`` instead of
torch 2.13's segfault. Where ``_swap_data_ptr_`` is missing (torch older than 2.2), torch's
own ``share_memory_()`` does the move and the storage travels through torch's handles.

Note [Process exit]
Block references are counted in shared memory. A process that exits while it still holds
tensors over blocks drops those references in a multiprocessing finalizer (lowest priority,
so after queues flushed and children were joined); a SIGKILLed process cannot, and its
blocks stay referenced until their owner exits (file_system names are reaped, see
``_C.reap_dead_segments``).
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import sys
import threading
from typing import Any, Optional, Tuple

import numpy as np
import torch

from .. import _C
from .limits import check_request
from .strategy import get_sharing_strategy

__all__ = [
    "allocate",
    "storage_from_block",
    "array_from_block",
    "share_storage",
    "move_storage_",
    "in_block",
    "can_swap",
    "numpy_in_blocks",
    "extent",
    "NUMPY_MIN_SHARED_BYTES",
]

log = logging.getLogger(__name__)


def _numpy_min_bytes(value: str) -> int:
    """``TORCH_MP_EXT_NUMPY_MIN_BYTES``: a size in bytes, or ``off``.

    Note [Arrays by value on request]: ``import torch_mp_ext`` registers a numpy reducer with
    ``ForkingPickler`` for the whole process, so even a stdlib ``Pool`` sends large arrays
    through the arena. ``off`` is the switch back to the standard library's behaviour: no
    ordinary array is ever large enough to be moved into a block (arrays born in one still
    cross as handles: they are shared memory already).
    """
    if value.strip().lower() == "off":
        return sys.maxsize
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"TORCH_MP_EXT_NUMPY_MIN_BYTES={value!r} is neither a size in bytes nor 'off': "
            "set it to the smallest array (in bytes) to send through shared memory, or to "
            "'off' to pickle numpy arrays by value as the standard library does") from None


#: numpy arrays smaller than this that are not already in shared memory are pickled by
#: value: for them a copy through the pipe is cheaper than a block (the result is the same,
#: since such arrays are copied either way).
NUMPY_MIN_SHARED_BYTES = _numpy_min_bytes(os.environ.get("TORCH_MP_EXT_NUMPY_MIN_BYTES",
                                                         str(64 * 1024)))


def extent(arr: np.ndarray) -> tuple[int, int]:
    """(offset of the lowest byte from arr's data pointer, bytes spanned) of an array."""
    low = high = 0
    for n, stride in zip(arr.shape, arr.strides):
        if stride < 0:
            low += stride * (n - 1)
        else:
            high += stride * (n - 1)
    return low, high - low + arr.itemsize

_move_lock = threading.Lock()
_used_file_system = False

can_swap = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def allocate(nbytes: int, strategy: Optional[str] = None) -> _C.Block:
    """A new block of at least ``nbytes`` for ``strategy`` (default: the current one)."""
    global _used_file_system
    named = (strategy or get_sharing_strategy()) == "file_system"
    check_request(nbytes, named)  # Note [Requests beyond memory]
    _used_file_system |= named
    return _C.allocate(nbytes, named)


def _check_span(block: _C.Block, offset: Any, nbytes: Any, what: str) -> None:
    """``[offset, offset + nbytes)`` must lie inside ``block`` (checked on Python integers:
    the libraries' own checks wrap around near 2^63, and a handle can carry anything)."""
    if (isinstance(offset, bool) or not isinstance(offset, int) or isinstance(nbytes, bool)
            or not isinstance(nbytes, int) or offset < 0 or nbytes < 0
            or offset + nbytes > block.capacity):
        raise ValueError(f"{what} of {nbytes!r} bytes at offset {offset!r} does not fit in a "
                         f"shared-memory block of {block.capacity} bytes")


def storage_from_block(block: _C.Block, offset: int, nbytes: int) -> torch.UntypedStorage:
    """A CPU storage viewing ``nbytes`` of ``block`` from ``offset``; keeps ``block`` alive."""
    _check_span(block, offset, nbytes, "a storage")
    view = torch.frombuffer(block, dtype=torch.uint8, count=nbytes, offset=offset)
    return view.untyped_storage()


def array_from_block(
    block: _C.Block, offset: int, shape: tuple, dtype: np.dtype, strides: Optional[tuple]
) -> np.ndarray:
    """A numpy array viewing ``block`` (its ``base`` keeps the block alive)."""
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise ValueError(f"arrays of dtype {dtype} hold Python objects and cannot view shared "
                         "memory")
    if not isinstance(shape, tuple) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"an array's shape must be a tuple of non-negative integers, got "
                         f"{shape!r}")
    if strides is not None and (not isinstance(strides, tuple) or len(strides) != len(shape)
                                or not all(isinstance(s, int) and not isinstance(s, bool)
                                           for s in strides)):
        raise ValueError(f"strides {strides!r} do not match shape {shape!r}")
    # The extent on Python integers: numpy's own check wraps around for offsets near 2^63.
    low = high = 0
    numel = 1
    for i, n in enumerate(shape):
        numel *= n
        step = dtype.itemsize * _prod(shape[i + 1:]) if strides is None else strides[i]
        if step < 0:
            low += step * max(n - 1, 0)
        else:
            high += step * max(n - 1, 0)
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"an array's offset must be an integer, got {offset!r}")
    if numel > 0:
        _check_span(block, offset + low, high - low + dtype.itemsize, "an array")
    # Block has the buffer protocol; numpy's stubs do not know it.
    return np.ndarray(shape, dtype=dtype, buffer=block,  # type: ignore[arg-type]
                      offset=offset, strides=strides)


def _prod(dims: tuple) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def in_block(address: int, nbytes: int) -> bool:
    """True if ``[address, address + nbytes)`` lies in a live block this process maps."""
    return _C.contains(address, nbytes)


def share_storage(storage: torch.UntypedStorage) -> Optional[Tuple[tuple, int]]:
    """``(handle, offset)`` with a new reference for a storage inside a block, else None."""
    return _C.share_address(storage.data_ptr(), storage.nbytes())


def move_storage_(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """Moves a non-empty CPU storage into shared memory in place (Note [Moving storages in
    place]); a storage already in a block, or shared by torch, is left as it is."""
    nbytes = storage.nbytes()
    if nbytes == 0 or storage.device.type != "cpu":
        return storage
    with _move_lock:  # two threads pickling one storage must not both move it
        if in_block(storage.data_ptr(), nbytes) or storage.is_shared():
            return storage
        if not can_swap:
            storage.share_memory_()
            return storage
        block = allocate(nbytes)
        fresh = storage_from_block(block, 0, nbytes)
        fresh.copy_(storage)
        storage._swap_data_ptr_(fresh)  # type: ignore[attr-defined]  # torch >= 2.1, private
        del fresh  # now holds the old memory: free it
    return storage


def _numpy_array_api() -> Optional[object]:
    """numpy's C-API capsule, where numpy has memory handlers (NEP 49, numpy >= 1.22)."""
    if np.lib.NumpyVersion(np.__version__) < "1.22.0":
        return None
    import importlib

    for name in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):
        try:
            return importlib.import_module(name)._ARRAY_API
        except (ImportError, AttributeError):
            continue
    return None


def numpy_in_blocks(enable: bool = True) -> bool:
    """Makes numpy allocate this thread's arrays of 64 KiB or more in arena blocks (or stops).

    Note [Arrays born shared] in ``csrc/shm/block_allocator.h``: such an array crosses to
    another process as a handle, without the copy an array in private memory costs. numpy's
    handler is per context, so only the calling thread (and contexts copied from it) is
    affected. Returns False, changing nothing, where numpy has no memory handlers.
    """
    api = _numpy_array_api()
    if api is None:
        return False
    _C.set_numpy_allocator(api, enable, max(NUMPY_MIN_SHARED_BYTES, 1))
    return True


def reclaim_after_death() -> None:
    """A child was joined: what dead processes held of named segments goes now (Note
    [Reclaiming names at run time] in ``csrc/shm/reclaim_named.cpp``). Even a child that
    exited normally may have been the last live holder of a name whose other holders were
    killed, and found its creator (or another exiting holder) still alive when it let go.
    Anonymous segments need nothing here: they vanish with their last mapping, and blocks of
    this process's pools come back when they run dry or on ``empty_cache()``."""
    if _used_file_system or get_sharing_strategy() == "file_system":
        _C.reclaim_named_segments()


#: Names the session of this run (Note [Session names] in ``csrc/shm/session.h``):
#: ``<tag hex>:<root pid>``, set by the run's first process, inherited by the others.
SESSION_ENV = "TORCH_MP_EXT_SESSION"


def _join_session() -> None:
    """Joins the run's session, or starts one as its root (Note [Session names])."""
    try:
        tag_hex, root = os.environ.get(SESSION_ENV, "").split(":")
        if _C.session_join(int(tag_hex, 16), int(root), False):
            return
    except ValueError:
        pass  # none inherited (or not ours): this process is a root
    # A new root sweeps the runs whose processes are all dead (one /dev/shm listing when there
    # are none): Note [A session on a full /dev/shm] in csrc/shm/session.h.
    try:
        _C.reap_dead_sessions(dry_run=False)
    except OSError as exc:  # never worth failing the import for: `cleanup` does it too
        log.debug("sweeping the sessions of dead runs failed (%s): `python -m torch_mp_ext "
                  "cleanup` removes them", exc)
    tag = int.from_bytes(os.urandom(8), "little") | 1
    if _C.session_join(tag, os.getpid(), True):
        os.environ[SESSION_ENV] = f"{tag:016x}:{os.getpid()}"
    else:
        log.debug("no session member table in /dev/shm: names of messages lost in flight "
                  "stay until `python -m torch_mp_ext cleanup --include-inflight`")


def _release_at_exit() -> None:
    _C.release_all()
    if _used_file_system:
        _C.reap_dead_segments()
    _C.session_end()  # the last member of the run sweeps its names (Note [Session names])


def _register_exit_hook() -> None:
    # Note [Process exit]: after the queues' finalizers (priority 10) and child joins.
    multiprocessing.util.Finalize(None, _release_at_exit, exitpriority=-100)


_join_session()
_register_exit_hook()
# Forked multiprocessing children clear inherited finalizers, then run after-fork hooks.
multiprocessing.util.register_after_fork(_register_exit_hook, lambda _: _register_exit_hook())
