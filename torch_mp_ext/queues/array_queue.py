"""A queue of same-shaped arrays over a fixed pool of shared-memory blocks: :class:`ArrayQueue`.

::

    producer                                    pool: maxsize blocks shaped like template
    put(arr): free slot i ◀── free ids ──┐      ┌────┬────┬────┬────┐
              copy arr into block i      │      │ b0 │ b1 │ b2 │ b3 │   (arena blocks,
              (no copy if arr is block i)│      └────┴────┴────┴────┘    mapped once each)
              ──────── items: i ─────────┼──▶ get(): a view of block i (zero-copy)
    new_array(): slot i to fill in place │    the view dies (all its views) ──▶ i is free again
                                         └──────────────────────────────────────────────────┘

The Stack Overflow answer this comes from (seeds/004) kept a pool of ``multiprocessing.Array``
buffers, sent slot ids through one queue and free ids through another, and copied each array
out again in ``get``. Here ``get`` returns a view of the block itself, whose slot goes back
to the pool when the last view of it is dropped, in whichever process; ``put`` of an array
that already is a slot (from :meth:`ArrayQueue.new_array`, or received from ``get``) sends it
without copying; items that are not arrays pass through; a wrong shape or dtype is a
``ValueError`` naming both. The queues are torch_mp_ext's crash-safe ones.

Note [ArrayQueue slots]
A slot is owned by exactly one party at a time: the free list, a producer (between taking it
and putting it), the items queue, or the arrays viewing it in one process. Those arrays share
one ``_Slot`` object as their base; its ``__del__`` puts the id back on the free list, unless
the slot was handed on by ``put`` (then the next owner frees it). After ``put``, the array is
the queue's: writing to it races with the receiver. A process killed while it owns a slot
takes that slot with it: the pool has one block fewer until the queue is recreated.
"""

from __future__ import annotations

import os
import queue
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from .. import _C
from ..errors import CorruptSegmentError
from ..sharing import memory as _memory
from ..sharing.pickling import DROPPERS
from ..timeouts import seconds
from .ring_queue import Queue

__all__ = ["ArrayQueue"]

Array = Union[np.ndarray, torch.Tensor]


#: Most arrays (pool blocks) one ArrayQueue holds.
MAX_ARRAYS = 1 << 16


def _describe(item: Array) -> Tuple[Tuple[int, ...], str]:
    """(shape, dtype name) with numpy and torch dtypes named alike ("float64", "bool")."""
    if isinstance(item, torch.Tensor):
        return tuple(item.shape), str(item.dtype).replace("torch.", "")
    return tuple(item.shape), item.dtype.name


class _Slot:
    """The base of every array viewing one pool block in this process (Note [ArrayQueue
    slots]); returns the block to the free list when the last of them dies."""

    def __init__(self, block: Any, index: int, free: Queue, nbytes: int, owner: int) -> None:
        self.__array_interface__ = {
            "version": 3, "shape": (nbytes,), "typestr": "|u1",
            "data": (block.address, False), "strides": None,
        }
        self.block = block  # keeps the memory mapped while a view lives
        self.index = index
        self.free = free
        self.handed_on = False
        self.owner = owner

    def __del__(self) -> None:
        if self.handed_on or os.getpid() != self.owner:  # a forked child's copy owns nothing
            return
        try:
            self.free.put(self.index, timeout=0)
        except Exception:  # noqa: BLE001 (the queue was closed, or this is interpreter exit)
            pass


class ArrayQueue:
    """A queue whose arrays travel through a pool of ``maxsize`` shared-memory blocks.

    Args:
        template: a numpy array or CPU tensor: every array put must have its shape and dtype
            (numpy and torch dtypes of the same name match), and ``get`` returns the same kind.
        maxsize: blocks in the pool, and the most items queued at once.

    Raises:
        TypeError: ``template`` is not a numpy array or a CPU tensor.
        ValueError: ``maxsize`` is not a positive integer, or ``template`` holds no bytes or
            Python objects.

    Example:
        ```python
        import numpy as np
        import torch_mp_ext as mp

        def produce(q):
            for i in range(3):
                a = q.new_array(timeout=60)   # a free block of the pool: no copy at all
                a[:] = i
                q.put(a)

        if __name__ == "__main__":
            q = mp.ArrayQueue(np.zeros((64, 64), np.float32), maxsize=2)
            p = mp.Process(target=produce, args=(q,))
            p.start()
            assert [float(q.get(timeout=60)[0, 0]) for _ in range(3)] == [0.0, 1.0, 2.0]
            p.join(60)
        ```
    """

    def __init__(self, template: Array, maxsize: int) -> None:
        if isinstance(template, torch.Tensor):
            if template.device.type != "cpu":
                raise TypeError(f"ArrayQueue templates are CPU tensors or numpy arrays, got a "
                                f"tensor on {template.device}")
            self._torch_dtype: Optional[torch.dtype] = template.dtype
            nbytes = template.numel() * template.element_size()
        elif isinstance(template, np.ndarray):
            if template.dtype.hasobject:
                raise ValueError("ArrayQueue cannot hold arrays of Python objects (dtype "
                                 f"{template.dtype}): their bytes are pointers")
            self._torch_dtype = None
            nbytes = template.nbytes
        else:
            raise TypeError("ArrayQueue(template, maxsize) takes a numpy array or a CPU tensor "
                            f"as its template, got {type(template).__qualname__}")
        if (isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1
                or maxsize > MAX_ARRAYS):
            raise ValueError(f"maxsize must be an integer from 1 to {MAX_ARRAYS} (the pool's "
                             f"blocks), got {maxsize!r}: an ArrayQueue cannot be unbounded")
        if nbytes == 0:
            raise ValueError(f"the template of shape {tuple(template.shape)} holds no bytes")
        self._shape, self._dtype_name = _describe(template)
        self._np_dtype = template.dtype if isinstance(template, np.ndarray) else None
        self._nbytes = nbytes
        self._maxsize = maxsize
        self._blocks = [_memory.allocate(nbytes) for _ in range(maxsize)]
        self._free = Queue(maxsize)
        self._free.put_many(range(maxsize))
        self._items = Queue(maxsize)
        self._setup()

    def _setup(self) -> None:
        self._addresses = {block.address: i for i, block in enumerate(self._blocks)}
        self._owned: Dict[int, weakref.ref[_Slot]] = {}
        self._u8: Dict[int, np.ndarray] = {}

    def __reduce__(self) -> tuple:
        meta = (self._shape, self._dtype_name, self._np_dtype, self._torch_dtype, self._nbytes,
                self._maxsize)
        return (_rebuild, (meta, [b.share() for b in self._blocks], self._free, self._items))

    def __repr__(self) -> str:
        return (f"<torch_mp_ext.ArrayQueue of {self._maxsize} x shape {self._shape} "
                f"{self._dtype_name}>")

    # -- slots ----------------------------------------------------------------------------
    def _bytes(self, index: int) -> np.ndarray:
        view = self._u8.get(index)
        if view is None:
            view = np.frombuffer(self._blocks[index], np.uint8,  # type: ignore[call-overload]
                                 self._nbytes)
            self._u8[index] = view
        return view

    def _shaped(self, u8: np.ndarray) -> Array:
        if self._torch_dtype is not None:
            return torch.from_numpy(u8).view(self._torch_dtype).view(self._shape)
        return u8.view(self._np_dtype).reshape(self._shape)  # type: ignore[arg-type]

    def _copy_into(self, index: int, item: Array) -> None:
        target = self._shaped(self._bytes(index))
        if isinstance(target, torch.Tensor):
            if isinstance(item, torch.Tensor):
                target.copy_(item.detach())
            else:
                np.copyto(target.numpy(), item, casting="equiv")
        else:
            source = item.detach().numpy() if isinstance(item, torch.Tensor) else item
            np.copyto(target, source, casting="equiv")

    def _array(self, index: int) -> Array:
        """A new array on slot ``index``, owned by this process (Note [ArrayQueue slots])."""
        slot = _Slot(self._blocks[index], index, self._free, self._nbytes, os.getpid())
        self._owned[index] = weakref.ref(slot)
        return self._shaped(np.asarray(slot))

    def _check(self, item: Array) -> None:
        shape, dtype = _describe(item)
        if shape != self._shape or dtype != self._dtype_name:
            raise ValueError(
                f"{self!r} holds arrays of shape {self._shape} and dtype {self._dtype_name} "
                f"(its template); got shape {shape} and dtype {dtype}. Put arrays like the "
                "template, or make an ArrayQueue for these.")
        if isinstance(item, torch.Tensor) and item.device.type != "cpu":
            raise ValueError(f"{self!r} holds CPU arrays; got a tensor on {item.device}")

    def _own_slot(self, item: Array) -> Optional[_Slot]:
        """The slot ``item`` covers entirely, if this process owns it and it was not handed on."""
        if isinstance(item, torch.Tensor):
            address, contiguous = item.data_ptr(), item.is_contiguous()
        else:
            address, contiguous = item.__array_interface__["data"][0], item.flags.c_contiguous
        index = self._addresses.get(address)
        if index is None or not contiguous:
            return None
        ref = self._owned.get(index)
        slot = ref() if ref is not None else None
        return slot if slot is not None and not slot.handed_on else None

    def new_array(self, block: bool = True, timeout: Optional[float] = None) -> Array:
        """A free block of the pool as an array to fill in place; :meth:`put` sends it
        without a copy (dropped without ``put``, it returns to the pool).

        Raises:
            queue.Full: no block was free in time.
        """
        try:
            index = self._free.get(block, timeout)
        except queue.Empty:
            raise queue.Full(f"no free block in {self!r} within {timeout} s: every one is "
                             "queued or held by arrays not yet dropped") from None
        return self._array(index)

    # -- the queue API --------------------------------------------------------------------
    def put(self, item: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        """Puts ``item``: an array through a block of the pool, anything else as it is.

        An array that covers a block it got from :meth:`new_array` or :meth:`get` is sent
        without a copy and belongs to the queue from then on; any other array is copied
        into a free block, waiting for one.

        Raises:
            ValueError: an array whose shape or dtype differs from the template's.
            queue.Full: no free block or no room in time (nothing was put).
        """
        if not isinstance(item, (np.ndarray, torch.Tensor)):
            self._items.put((item,), block, timeout)
            return
        self._check(item)
        timeout = seconds(timeout, negative_ok=True)  # Note [Timeout values]
        end = None if timeout is None or not block else time.monotonic() + timeout
        slot = self._own_slot(item)
        if slot is not None:
            index = slot.index
        else:
            try:
                index = self._free.get(block, timeout)
            except queue.Empty:
                raise queue.Full(f"no free block in {self!r} within {timeout} s") from None
            try:
                self._copy_into(index, item)
            except BaseException:
                self._free.put(index)
                raise
        left = None if end is None else max(end - time.monotonic(), 0.0)
        try:
            self._items.put(index, block, left)
        except BaseException:
            if slot is None:
                self._free.put(index)
            raise
        if slot is not None:
            slot.handed_on = True  # Note [ArrayQueue slots]: the receiver frees it now

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        """Removes the oldest item: an array viewing its block (zero-copy; the block returns
        to the pool when the array and its views are dropped), or the item put.

        Raises:
            queue.Empty: nothing arrived in time.
        """
        message = self._items.get(block, timeout)
        if type(message) is int:
            return self._array(message)
        return message[0]

    def put_nowait(self, item: Any) -> None:
        """``put(item, False)``."""
        self.put(item, False)

    def get_nowait(self) -> Any:
        """``get(False)``."""
        return self.get(False)

    def qsize(self) -> int:
        """Items queued now."""
        return self._items.qsize()

    def empty(self) -> bool:
        """True if no item was queued when checked."""
        return self._items.empty()

    def full(self) -> bool:
        """True if ``maxsize`` items were queued when checked."""
        return self._items.full()

    def free_blocks(self) -> int:
        """Blocks of the pool neither queued nor held by arrays, when checked."""
        return self._free.qsize()

    def close(self) -> None:
        """Closes this process's queue objects (arrays already returned stay valid)."""
        self._items.close()
        self._free.close()

    @property
    def maxsize(self) -> int:
        """Blocks in the pool, and the most items queued."""
        return self._maxsize

    @property
    def shape(self) -> Tuple[int, ...]:
        """The template's shape."""
        return self._shape


def _rebuild(meta: tuple, handles: List[tuple], free: Queue, items: Queue) -> ArrayQueue:
    self = ArrayQueue.__new__(ArrayQueue)
    (self._shape, self._dtype_name, self._np_dtype, self._torch_dtype, self._nbytes,
     self._maxsize) = meta
    self._blocks = [_C.attach(h) for h in handles]
    _check_meta(self)
    self._free, self._items = free, items
    self._setup()
    return self


def _check_meta(q: ArrayQueue) -> None:
    """A pickled ArrayQueue's layout must fit its blocks: its arrays view ``_nbytes`` bytes
    at each block's address, so a forged size would read and write past the block."""
    nbytes, shape = q._nbytes, q._shape
    ok = (isinstance(nbytes, int) and nbytes > 0 and isinstance(shape, tuple)
          and all(isinstance(d, int) and d >= 0 for d in shape)
          and isinstance(q._maxsize, int) and q._maxsize == len(q._blocks)
          and all(block.capacity >= nbytes for block in q._blocks))
    if ok:
        if q._torch_dtype is not None:
            itemsize = torch.empty((), dtype=q._torch_dtype).element_size()
        else:
            itemsize = np.dtype(q._np_dtype).itemsize
        numel = 1
        for d in shape:
            numel *= d
        ok = numel * itemsize == nbytes
    if not ok:
        raise CorruptSegmentError(
            f"a pickled ArrayQueue describes {q._maxsize!r} arrays of shape {shape!r} in "
            f"{nbytes!r} bytes, which do not fit its {len(q._blocks)} blocks: the pickle was "
            "forged or corrupted")


def _drop_rebuild(meta: tuple, handles: List[tuple], *queues: Any) -> None:
    """An ArrayQueue in a pickle nobody will load (Note [Releasing dropped frames]): its
    blocks' references go; its two queues were dropped by their own dropper."""
    for handle in handles:
        _C.release_handle(handle)


DROPPERS[(__name__, "_rebuild")] = _drop_rebuild
