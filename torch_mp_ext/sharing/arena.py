"""Tensors and arrays born in shared memory, and moving existing ones there in place.

A tensor from :func:`empty` lives in a pooled shared-memory block from the start: sending it
to another process sends a handle of a few dozen bytes, whatever its size, and the receiver
maps the same pages (Note [Arena size classes] in ``csrc/shm/arena.h``). :func:`share_` moves
existing tensors, modules and state_dicts there, in place, like ``share_memory_()``.

Example::

    import torch_mp_ext as mp
    batch = mp.empty(256, 3, 224, 224)          # already shared: sending copies nothing
    frames = mp.empty_array((64, 480, 640), "uint8")
    model = mp.share_(model)                    # parameters and buffers moved in place
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, Union

import numpy as np
import torch

from .. import _C
from . import memory as _memory

__all__ = [
    "empty",
    "zeros",
    "empty_like",
    "empty_array",
    "zeros_array",
    "share_",
    "is_shared",
    "empty_cache",
    "memory_stats",
]

_SizeArg = Union[int, Sequence[int], torch.Size]
T = TypeVar("T")


#: Largest block the arena hands out (the core's limit: 64 TiB).
MAX_BLOCK_BYTES = 1 << 46


def _parse_size(size: tuple) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    out = []
    for dim in size:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 0:
            raise ValueError(f"sizes must be non-negative integers, got {size!r}")
        out.append(int(dim))
    return tuple(out)


def _nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of an array of ``shape``, computed without wrapping (Python integers)."""
    nbytes = itemsize
    for dim in shape:
        nbytes *= dim
    if nbytes > MAX_BLOCK_BYTES:
        raise ValueError(f"size {shape} of {itemsize}-byte elements is {nbytes} bytes, more "
                         f"than the {MAX_BLOCK_BYTES} bytes a shared-memory block can hold")
    return nbytes


def empty(*size: _SizeArg, dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor in shared memory (like ``torch.empty``).

    Args:
        *size: the shape, as integers or one sequence.
        dtype: defaults to ``torch.get_default_dtype()``.
        requires_grad: whether autograd records operations on it.

    Example:
        ```python
        import torch
        import torch_mp_ext as mp

        t = mp.empty(2, 3, dtype=torch.float16)   # or mp.empty((2, 3))
        t.fill_(1)
        assert t.shape == (2, 3) and mp.is_shared(t)
        ```
    """
    shape = _parse_size(size)
    dtype = dtype or torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    nbytes = _nbytes(shape, torch.empty((), dtype=dtype).element_size())
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, requires_grad=requires_grad)
    storage = _memory.storage_from_block(_memory.allocate(nbytes), 0, nbytes)
    tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]
    return tensor.requires_grad_(requires_grad)


def zeros(*size: _SizeArg, dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> torch.Tensor:
    """A zero-filled CPU tensor in shared memory (like ``torch.zeros``).

    Args:
        *size: the shape, as integers or one sequence.
        dtype: defaults to ``torch.get_default_dtype()``.
        requires_grad: whether autograd records operations on it.

    Example:
        ```python
        import torch_mp_ext as mp

        counts = mp.zeros(4)
        assert counts.sum().item() == 0 and mp.is_shared(counts)
        ```
    """
    tensor = empty(*size, dtype=dtype)
    tensor.zero_()
    return tensor.requires_grad_(requires_grad)


def empty_like(
    tensor: torch.Tensor, *, dtype: torch.dtype | None = None, requires_grad: bool = False
) -> torch.Tensor:
    """An uninitialised shared-memory tensor with ``tensor``'s shape (contiguous).

    Args:
        tensor: the tensor whose shape (and, by default, dtype) to take.
        dtype: overrides ``tensor``'s dtype.
        requires_grad: whether autograd records operations on it.

    Example:
        ```python
        import torch
        import torch_mp_ext as mp

        batch = torch.randn(8, 3)
        shared = mp.empty_like(batch).copy_(batch)
        assert torch.equal(shared, batch) and mp.is_shared(shared)
        ```
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"empty_like() takes a tensor, got {type(tensor).__name__}")
    return empty(tensor.shape, dtype=dtype or tensor.dtype, requires_grad=requires_grad)


def empty_array(shape: _SizeArg, dtype: Any = np.float64) -> np.ndarray:
    """An uninitialised numpy array in shared memory (like ``numpy.empty``).

    Args:
        shape: an int or a sequence of ints.
        dtype: anything ``numpy.dtype`` accepts, except object dtypes.

    Example:
        ```python
        import numpy as np
        import torch_mp_ext as mp

        frame = mp.empty_array((480, 640, 3), np.uint8)
        frame[:] = 255
        assert mp.is_shared(frame)   # crosses processes as a handle, never copied
        ```
    """
    shape = _parse_size((shape,))  # an int too: negative sizes are ValueError here
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype {dtype!r} is not a numpy dtype: {exc}") from None
    if dtype.hasobject:
        raise ValueError(f"arrays of dtype {dtype} hold Python objects and cannot be shared")
    nbytes = _nbytes(shape, dtype.itemsize)
    if nbytes == 0:
        return np.empty(shape, dtype=dtype)
    return _memory.array_from_block(_memory.allocate(nbytes), 0, shape, dtype, None)


def zeros_array(shape: _SizeArg, dtype: Any = np.float64) -> np.ndarray:
    """A zero-filled numpy array in shared memory (like ``numpy.zeros``).

    Args:
        shape: an int or a sequence of ints.
        dtype: anything ``numpy.dtype`` accepts, except object dtypes.

    Example:
        ```python
        import torch_mp_ext as mp

        acc = mp.zeros_array(1000)
        assert acc.sum() == 0 and mp.is_shared(acc)
        ```
    """
    arr = empty_array(shape, dtype)
    arr.fill(0)
    return arr


def is_shared(obj: torch.Tensor | np.ndarray) -> bool:
    """True if ``obj``'s memory is in a torch_mp_ext block or torch's shared memory.

    ``Tensor.is_shared()`` only knows torch's own allocators, so it answers False for
    arena tensors (see docs/migration.md).

    Raises:
        TypeError: ``obj`` is neither a tensor nor a numpy array.

    Args:
        obj: a tensor (CPU or CUDA) or a numpy array.

    Example:
        ```python
        import numpy as np
        import torch
        import torch_mp_ext as mp

        assert mp.is_shared(mp.empty(3)) and not mp.empty(3).is_shared()
        assert not mp.is_shared(torch.empty(3)) and not mp.is_shared(np.empty(3))
        ```
    """
    if not isinstance(obj, (torch.Tensor, np.ndarray)):
        raise TypeError(f"is_shared() takes a tensor or a numpy array, got "
                        f"{type(obj).__name__}")
    if isinstance(obj, np.ndarray):
        low, span = _memory.extent(obj)
        return obj.size > 0 and _C.contains(obj.__array_interface__["data"][0] + low, span)
    storage = obj.untyped_storage()
    if storage.device.type != "cpu":
        return storage.is_shared()
    return _C.contains(storage.data_ptr(), storage.nbytes()) or storage.is_shared()


def share_(obj: T) -> T:
    """Moves tensors into shared memory in place and returns ``obj``.

    ``obj`` may be a tensor, a ``torch.nn.Module`` (parameters and buffers), or a dict,
    list or tuple of those, nested (a ``state_dict``). Every view of a moved storage follows
    it (Note [Moving storages in place] in ``sharing/memory.py``). Tensors already shared stay put.

    Args:
        obj: a tensor, an ``nn.Module``, or a dict, list or tuple of them.

    Returns:
        ``obj`` itself.

    Raises:
        TypeError: ``obj`` is none of those.

    Example:
        ```python
        import torch
        import torch_mp_ext as mp

        model = mp.share_(torch.nn.Linear(4, 2))   # for Hogwild-style workers
        assert all(mp.is_shared(p) for p in model.parameters())
        ```
    """
    if isinstance(obj, torch.Tensor):
        _memory.move_storage_(obj.untyped_storage())
    elif isinstance(obj, torch.nn.Module):
        for tensor in list(obj.parameters()) + list(obj.buffers()):
            _memory.move_storage_(tensor.untyped_storage())
    elif isinstance(obj, Mapping):
        for value in obj.values():
            share_(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            share_(value)
    else:
        raise TypeError(
            "share_() takes a tensor, an nn.Module, or a dict/list/tuple of them, "
            f"got {type(obj).__name__}"
        )
    return obj


def empty_cache() -> int:
    """Returns fully free pooled segments of this process to the OS; returns bytes freed.

    Example:
        ```python
        import torch_mp_ext as mp

        t = mp.empty(1 << 20)
        del t
        freed = mp.empty_cache()   # 0 when every segment still has a live block
        assert freed >= 0
        ```
    """
    return _C.empty_cache()


def memory_stats() -> dict[str, int]:
    """This process's arena and mapping counters (segments, bytes, live blocks, ...).

    Example:
        ```python
        import torch_mp_ext as mp

        t = mp.empty(1024)
        stats = mp.memory_stats()
        assert all(isinstance(v, int) for v in stats.values())
        print(sorted(stats))
        ```
    """
    return dict(_C.arena_stats())
