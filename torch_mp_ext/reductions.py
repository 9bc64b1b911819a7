"""Pickling tensors, storages and numpy arrays through shared memory (``reduce_*``/``rebuild_*``).

Mirrors ``torch.multiprocessing.reductions`` (every public name there exists here) with one
change of mechanism: CPU storages travel as handles to arena blocks (``rebuild_storage``)
instead of one fd or one ``/dev/shm`` file per storage. Storages that torch itself put in
shared memory (``share_memory_()``, DataLoader batches) still travel through torch's handles.
CUDA tensors travel as torch's IPC handle plus a keep-alive slot in one of our counter files
(Note [CUDA lifetimes] in ``cuda/ipc.py``), through ``rebuild_cuda_tensor`` with torch's
signature; received CUDA tensors can be sent on.

Note [Identity of rebuilt storages]
Each process keeps ``shared_cache``: block handle key -> weak reference to the storage built
on it. The sender records its own storage when reducing, receivers when rebuilding, so the
same storage sent twice (or as several views) rebuilds as one storage, and a round trip
inside one process returns the very same storage (torch's ``test_*_preserve_sharing``). A
cache hit gives back the reference its handle carried, since the cached storage already
holds one.

Payloads name this module (``torch_mp_ext.reductions.rebuild_*``): the receiving process
imports torch_mp_ext while unpickling, and must have it installed.
"""

from __future__ import annotations

from multiprocessing import reduction
from typing import Any, cast

import numpy as np
import torch
import torch.utils.hooks
from torch.multiprocessing import reductions as _torch_reductions
from torch.multiprocessing.reductions import (  # re-exported: same behaviour as torch
    SharedCache,
    StorageWeakRef,
    fd_id,
    rebuild_event,
    rebuild_meta_tensor,
    rebuild_nested_tensor,
    rebuild_sparse_compressed_tensor,
    rebuild_sparse_coo_tensor,
    rebuild_storage_fd,
    rebuild_storage_filename,
    reduce_event,
    reduce_nested_tensor,
    reduce_sparse_tensor,
)

from . import _C
from . import torch_internals as _ti
from .cuda import ipc as _cuda_ipc
from .sharing import byvalue
from .sharing import memory as _memory
from .sharing import records as _records

__all__ = [
    "SharedCache",
    "StorageWeakRef",
    "fd_id",
    "init_reductions",
    "rebuild_array",
    "rebuild_cpu_tensor",
    "rebuild_cuda_tensor",
    "rebuild_event",
    "rebuild_meta_tensor",
    "rebuild_nested_tensor",
    "rebuild_sparse_compressed_tensor",
    "rebuild_sparse_coo_tensor",
    "rebuild_storage",
    "rebuild_storage_empty",
    "rebuild_storage_fd",
    "rebuild_storage_filename",
    "rebuild_tensor",
    "rebuild_typed_storage",
    "rebuild_typed_storage_child",
    "reduce_array",
    "reduce_cuda_tensor",
    "reduce_event",
    "reduce_nested_tensor",
    "reduce_sparse_tensor",
    "reduce_storage",
    "reduce_tensor",
    "reduce_typed_storage",
    "reduce_typed_storage_child",
    "shared_cache",
    "storage_from_cache",
]

shared_cache = _records.shared_cache
"""Storages rebuilt or sent by this process, by handle: the same block rebuilds as the same
storage (torch's ``shared_cache``, keyed by our handles; compact tensor records share it
(Note [Lean tensor records] in ``sharing/records.py``)).

Example:
    ```python
    import pickle
    from multiprocessing.reduction import ForkingPickler
    import torch
    import torch_mp_ext as mp
    from torch_mp_ext.reductions import shared_cache

    t = mp.empty(4)
    u = pickle.loads(ForkingPickler.dumps(t))   # sent and rebuilt in this process
    assert u.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()   # via the cache
    ```
"""

def _cache_key(handle: tuple, offset: int, nbytes: int) -> tuple:
    # (segment id, block index, generation, offset, nbytes): Note [Identity of rebuilt storages]
    return ("tmx", handle[1], handle[4], handle[5], offset, nbytes)


def storage_from_cache(cls: Any, key: Any) -> torch.UntypedStorage | None:
    """The live storage cached under ``key`` in this process, or None.

    Args:
        cls: the storage class (unused: every storage here is untyped).
        key: a block handle's cache key.

    Example:
        ```python
        import pickle
        from multiprocessing.reduction import ForkingPickler
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.reductions import storage_from_cache

        assert storage_from_cache(torch.UntypedStorage, ("no such handle",)) is None
        ```
    """
    storage_ref = shared_cache.get(key)
    if storage_ref is None:
        return None
    return _ti.new_with_weak_ptr(storage_ref.cdata)


# ---- storages -----------------------------------------------------------------------------


def rebuild_storage_empty(cls: Any) -> Any:
    """Rebuilds an empty storage (nothing to share).

    Example:
        ```python
        import pickle
        from multiprocessing.reduction import ForkingPickler
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.reductions import rebuild_storage_empty

        assert rebuild_storage_empty(torch.UntypedStorage).nbytes() == 0
        ```
    """
    return cls()


def _storage_from_handle(handle: tuple, offset: int, nbytes: int) -> torch.UntypedStorage:
    """The storage on a block handle: the cached one (giving the handle's reference back)
    or a new zero-copy view adopting it (Note [Identity of rebuilt storages])."""
    key = _cache_key(handle, offset, nbytes)
    storage = storage_from_cache(torch.UntypedStorage, key)
    if storage is not None:
        _C.release_handle(handle)  # the cached storage already holds a reference
        return storage
    storage = _memory.storage_from_block(_C.attach(handle), offset, nbytes)
    shared_cache[key] = StorageWeakRef(storage)
    return storage


def _share(storage: torch.UntypedStorage) -> tuple[tuple, int] | None:
    """(handle, offset) for a non-empty CPU storage, moving it into the arena if needed; None
    for storages torch put in shared memory itself (they keep torch's handles)."""
    shared = _memory.share_storage(storage)
    if shared is None:
        if storage.is_shared():
            return None
        _memory.move_storage_(storage)
        shared = _memory.share_storage(storage)  # None if torch < 2.2 moved it (torch's way)
        if shared is None:
            return None
    handle, offset = shared
    shared_cache[_cache_key(handle, offset, storage.nbytes())] = StorageWeakRef(storage)
    return shared


def rebuild_storage(cls: Any, handle: tuple, offset: int, nbytes: int) -> torch.UntypedStorage:
    """Rebuilds a storage from a block handle (zero-copy), taking over its reference.

    Example:
        ```python
        import pickle
        from multiprocessing.reduction import ForkingPickler
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.reductions import rebuild_storage

        from torch_mp_ext.reductions import reduce_storage

        storage = mp.empty(8).untyped_storage()
        rebuild, args = reduce_storage(storage)
        assert rebuild is rebuild_storage and rebuild(*args).nbytes() == storage.nbytes()
        ```
    """
    return _storage_from_handle(handle, offset, nbytes)


def reduce_storage(storage: torch.UntypedStorage) -> tuple:
    """Pickles a CPU storage as a block handle, moving it into shared memory first if needed
    (Note [Moving storages in place] in ``sharing/memory.py``).

    Args:
        storage: the storage being pickled.

    Example:
        ```python
        import pickle
        from multiprocessing.reduction import ForkingPickler
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.reductions import reduce_storage

        storage = mp.empty(8).untyped_storage()
        rebuild, args = reduce_storage(storage)
        assert rebuild(*args).data_ptr() == storage.data_ptr()   # the same storage again
        ```
    """
    if storage.device.type != "cpu":  # CUDA / meta storages: torch's refusal and messages
        return _torch_reductions.reduce_storage(storage)
    nbytes = storage.nbytes()
    if nbytes == 0:
        return (rebuild_storage_empty, (type(storage),))
    shared = _share(storage)
    if shared is None:
        return _torch_reductions.reduce_storage(storage)
    return (rebuild_storage, (type(storage), shared[0], shared[1], nbytes))


def rebuild_typed_storage(storage: Any, dtype: torch.dtype) -> torch.TypedStorage:
    """torch's ``rebuild_typed_storage``, refusing a CPU storage that is not aligned for
    ``dtype``: a forged handle offset placed a complex128 storage at an odd address, and
    torch's kernels die of SIGSEGV writing such memory (``records.check_aligned``)."""
    _records.check_storage_aligned(storage, dtype)
    return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def reduce_typed_storage(storage: torch.TypedStorage) -> tuple:
    """Pickles a ``TypedStorage`` as its untyped storage (a block handle) and its dtype."""
    return (rebuild_typed_storage, (storage._untyped_storage, storage.dtype))


def rebuild_typed_storage_child(storage: Any, storage_type: Any) -> Any:
    """torch's ``rebuild_typed_storage_child`` (``torch.FloatStorage`` and the like), with
    the alignment check of :func:`rebuild_typed_storage`."""
    _records.check_storage_aligned(storage, storage_type.dtype)
    return storage_type(wrap_storage=storage, _internal=True)


def reduce_typed_storage_child(storage: Any) -> tuple:
    """Pickles a legacy typed storage (``torch.FloatStorage`` ...) as its untyped storage."""
    return (rebuild_typed_storage_child, (storage._untyped_storage, type(storage)))


# ---- tensors ------------------------------------------------------------------------------


def rebuild_tensor(cls: Any, storage: Any, metadata: tuple) -> torch.Tensor:
    """Rebuilds a tensor (or ``Parameter``) on a rebuilt storage, as torch's does.

    Example:
        ```python
        import pickle
        from multiprocessing.reduction import ForkingPickler
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.reductions import rebuild_tensor

        untyped = pickle.loads(ForkingPickler.dumps(mp.empty(4).fill_(1).untyped_storage()))
        storage = torch.TypedStorage(wrap_storage=untyped, dtype=torch.float32, _internal=True)
        metadata = (0, (4,), (1,), False)   # storage offset, size, stride, requires_grad
        t = rebuild_tensor(torch.Tensor, storage, metadata)
        assert t.eq(1).all()
        ```
    """
    storage_offset, size, stride, requires_grad = metadata
    t = _ti.rebuild_tensor(storage, storage_offset, size, stride)
    if cls == torch.nn.parameter.Parameter:
        # requires_grad goes into the constructor: integer Parameters must get False there.
        t = torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    else:
        t.requires_grad = requires_grad
    return t


def rebuild_cpu_tensor(
    handle: tuple,
    offset: int,
    nbytes: int,
    dtype: torch.dtype,
    size: tuple,
    stride: tuple,
    storage_offset: int,
    requires_grad: bool,
    cls: type | None,
) -> torch.Tensor:
    """Rebuilds a CPU tensor viewing a block (zero-copy), taking over the handle's reference.

    Example:
        ```python
        import pickle
        from multiprocessing.reduction import ForkingPickler
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.reductions import rebuild_cpu_tensor

        from torch_mp_ext.reductions import reduce_tensor

        t = mp.empty(4).fill_(7)
        rebuild, args = reduce_tensor(t)
        assert rebuild is rebuild_cpu_tensor and rebuild(*args).eq(7).all()
        ```
    """
    storage = _storage_from_handle(handle, offset, nbytes)
    t = _records.check_aligned(
        torch.empty((0,), dtype=dtype).set_(storage, storage_offset, size, stride))
    if cls is torch.nn.parameter.Parameter:
        # requires_grad goes into the constructor: integer Parameters must get False there.
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad = True
    return t


def rebuild_cuda_tensor(
    tensor_cls: type,
    tensor_size: tuple,
    tensor_stride: tuple,
    tensor_offset: int,
    storage_cls: type,
    dtype: torch.dtype,
    storage_device: int,
    storage_handle: bytes | None,
    storage_size_bytes: int,
    storage_offset_bytes: int,
    requires_grad: bool,
    ref_counter_handle: Any,
    ref_counter_offset: int,
    event_handle: bytes | None,
    event_sync_required: bool | None,
) -> torch.Tensor:
    """Rebuilds a CUDA tensor on a block of another process (torch's signature).

    ``ref_counter_handle`` is our keep-alive ticket (Note [CUDA lifetimes]) when torch_mp_ext
    sent the tensor; bytes (torch's counter file, as ``storage._share_cuda_()`` returns) are
    handed to torch's own ``rebuild_cuda_tensor``.

    Example:
        ```python
        import pickle
        from multiprocessing.reduction import ForkingPickler
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.reductions import rebuild_cuda_tensor

        assert callable(rebuild_cuda_tensor)   # what a receiver of a CUDA tensor calls;
        # with a GPU: pickle.loads(ForkingPickler.dumps(t)) in another process runs it
        ```
    """
    if not _cuda_ipc.is_ticket(ref_counter_handle) and storage_handle is not None:
        return _torch_reductions.rebuild_cuda_tensor(
            tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype,
            storage_device, storage_handle, storage_size_bytes, storage_offset_bytes,
            requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
            event_sync_required,
        )
    if storage_handle is None or storage_size_bytes == 0:
        storage = storage_cls(0, dtype=dtype, device=storage_device, _internal=True)
        untyped = (storage if isinstance(storage, torch.UntypedStorage)
                   else storage._untyped_storage)
    else:
        untyped = _cuda_ipc.receive(
            storage_device, storage_handle, storage_size_bytes, storage_offset_bytes,
            ref_counter_handle, ref_counter_offset, event_handle, event_sync_required,
        )
    t = _ti.rebuild_tensor(
        torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True),
        tensor_offset, tensor_size, tensor_stride,
    )
    if tensor_cls == torch.nn.parameter.Parameter:
        # requires_grad goes into the constructor: integer Parameters must get False there.
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    t.requires_grad = requires_grad
    return t


def reduce_cuda_tensor(tensor: torch.Tensor) -> tuple:
    """Pickles a strided CUDA tensor: the IPC handle of its allocation, its offset, and a
    keep-alive slot (or, for a received tensor, the original handle and a new slot of its
    producer's counter file).

    Args:
        tensor: a CUDA tensor being pickled.

    Example:
        ```python
        import pickle
        from multiprocessing.reduction import ForkingPickler
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.reductions import reduce_cuda_tensor

        if torch.cuda.is_available():   # a CUDA tensor crosses as torch's IPC handle
            rebuild, args = reduce_cuda_tensor(torch.ones(3, device="cuda"))
            print(rebuild.__name__)
        ```
    """
    torch.utils.hooks.warn_if_has_hooks(tensor)
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0 or storage.data_ptr() == 0:
        shared: tuple = (tensor.device.index, None, 0, 0, None, 0, None, None)
    else:
        shared = _cuda_ipc.send(storage)
    device, handle, nbytes, offset, ticket, slot, event_handle, event_sync = shared
    return (
        rebuild_cuda_tensor,
        (type(tensor), tensor.size(), tensor.stride(), tensor.storage_offset(),
         torch.storage.TypedStorage, tensor.dtype, device, handle, nbytes, offset,
         tensor.requires_grad, ticket, slot, event_handle, event_sync),
    )


def reduce_tensor(tensor: torch.Tensor) -> tuple:
    """Pickles a tensor: a CPU tensor as one block handle plus its layout, a CUDA tensor by
    IPC handle and keep-alive slot; the rest as torch does (meta, nested, sparse -- whose
    parts come back here).

    Args:
        tensor: the tensor being pickled.

    Example:
        ```python
        import pickle
        from multiprocessing.reduction import ForkingPickler
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.reductions import reduce_tensor

        t = mp.zeros(2, 3)
        rebuild, args = reduce_tensor(t)   # what ForkingPickler calls for a tensor
        u = rebuild(*args)
        assert u.shape == (2, 3) and u.data_ptr() == t.data_ptr()
        ```
    """
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError(
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, "
            "since autograd does not support crossing process boundaries.  "
            "If you just want to transfer the data, call detach() on the tensor "
            "before serializing (e.g., putting it on the queue)."
        )
    if tensor.is_nested or tensor.layout != torch.strided:
        return _torch_reductions.reduce_tensor(tensor)
    if tensor.device.type == "cuda":
        return reduce_cuda_tensor(tensor)
    if tensor.device.type != "cpu":
        return _torch_reductions.reduce_tensor(tensor)
    torch.utils.hooks.warn_if_has_hooks(tensor)
    # Gradients and hooks are not sent (Note [Don't serialize hooks] in torch).
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    shared = _share(storage) if nbytes else None
    if shared is None:  # empty, or in torch's shared memory: torch's layout of the payload
        metadata = (tensor.storage_offset(), tensor.size(), tensor.stride(), tensor.requires_grad)
        return (rebuild_tensor, (type(tensor), tensor._typed_storage(), metadata))
    cls = type(tensor)
    return (
        rebuild_cpu_tensor,
        (shared[0], shared[1], nbytes, tensor.dtype, tuple(tensor.shape), tensor.stride(),
         tensor.storage_offset(), tensor.requires_grad, None if cls is torch.Tensor else cls),
    )


# ---- numpy --------------------------------------------------------------------------------


def rebuild_array(
    handle: tuple, offset: int, shape: tuple, dtype: np.dtype, strides: tuple, writeable: bool
) -> np.ndarray:
    """Rebuilds a numpy array viewing a block (zero-copy), taking over its reference.

    Example:
        ```python
        import pickle
        from multiprocessing.reduction import ForkingPickler
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.reductions import rebuild_array

        import numpy as np

        a = mp.empty_array((3, 4), np.int32)
        a[:] = 5
        b = pickle.loads(ForkingPickler.dumps(a))   # calls rebuild_array: a view, no copy
        b[0, 0] = 9
        assert a[0, 0] == 9
        ```
    """
    arr = _memory.array_from_block(_C.attach(handle), offset, shape, dtype, strides)
    if not writeable:
        arr.flags.writeable = False
    return arr


def reduce_array(arr: np.ndarray) -> tuple:
    """Pickles a numpy array: by handle if it lives in a block (zero-copy both ways), else
    copied once into a new block, or by value when small or of object dtype.

    Args:
        arr: the array being pickled.

    Example:
        ```python
        import pickle
        from multiprocessing.reduction import ForkingPickler
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.reductions import reduce_array

        import numpy as np

        a = np.arange(100_000.0)   # 800 KB: copied once into a shared block
        rebuild, args = reduce_array(a)
        b = rebuild(*args)
        assert mp.is_shared(b) and np.array_equal(a, b)
        ```
    """
    if arr.dtype.hasobject or arr.size == 0:
        return cast(tuple, arr.__reduce__())
    data = arr.__array_interface__["data"][0]
    low, span = _memory.extent(arr)
    shared = _C.share_address(data + low, span)
    if shared is not None:
        handle, offset = shared
        return (
            rebuild_array,
            (handle, offset - low, arr.shape, arr.dtype, arr.strides, arr.flags.writeable),
        )
    if arr.nbytes < _memory.NUMPY_MIN_SHARED_BYTES:
        return cast(tuple, arr.__reduce__())
    block = _memory.allocate(arr.nbytes)
    copy = _memory.array_from_block(block, 0, arr.shape, arr.dtype, None)
    np.copyto(copy, arr, casting="no")
    return (rebuild_array, (block.share(), 0, arr.shape, arr.dtype, copy.strides, True))


# ---- registration -------------------------------------------------------------------------


def init_reductions() -> None:
    """Registers the reducers with ``multiprocessing.reduction.ForkingPickler``.

    Registration is process-wide and by exact type (the last registration wins): this
    replaces torch's reducers for CPU storages and for CPU and CUDA tensors, and keeps
    torch's for the rest (``torch.cuda.Event`` keeps ``reduce_event``/``rebuild_event``).

    Example:
        ```python
        import pickle
        from multiprocessing.reduction import ForkingPickler
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.reductions import init_reductions

        init_reductions()   # done by the import already; idempotent
        t = torch.ones(3)
        u = pickle.loads(ForkingPickler.dumps(t))   # t moved to shared memory, u shares it
        assert mp.is_shared(t) and u.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        ```
    """
    reduction.register(torch.cuda.Event, reduce_event)
    for t in _ti.storage_classes:
        if t.__name__ == "UntypedStorage":
            reduction.register(t, reduce_storage)
        else:
            reduction.register(t, reduce_typed_storage_child)
    reduction.register(torch.storage.TypedStorage, reduce_typed_storage)
    for tensor_cls in _ti.tensor_classes:
        reduction.register(tensor_cls, reduce_tensor)
    reduction.register(torch.Tensor, reduce_tensor)
    reduction.register(torch.nn.parameter.Parameter, reduce_tensor)
    reduction.register(np.ndarray, reduce_array)
    # ProcessPoolExecutor's work items (Note [By-value fallback] in sharing/byvalue.py).
    reduction.register(byvalue.CALL_ITEM, byvalue.reduce_call_item)
