"""The arena API: tensors and arrays born in shared memory, share_(), recycling."""

from __future__ import annotations

import _workers
import numpy as np
import pytest
import torch

import torch_mp_ext as mp
from torch_mp_ext import _C


def test_empty_and_zeros_shapes_dtypes_and_grad():
    t = mp.empty(3, 4, dtype=torch.int16)
    assert t.shape == (3, 4) and t.dtype == torch.int16 and t.is_contiguous()
    assert mp.is_shared(t) and not t.untyped_storage().is_shared()  # torch cannot tell
    assert mp.empty((2, 5)).shape == (2, 5) and mp.empty(torch.Size([7])).shape == (7,)
    g = mp.zeros(5, requires_grad=True)
    assert g.requires_grad and g.is_leaf and g.dtype == torch.get_default_dtype()
    assert mp.empty(0, 3).shape == (0, 3)
    like = mp.empty_like(torch.ones(2, 3, dtype=torch.float64))
    assert like.shape == (2, 3) and like.dtype == torch.float64 and mp.is_shared(like)


def test_zeros_are_zero_in_a_recycled_block():
    dirty = mp.empty(1000)
    dirty.fill_(7)
    address = dirty.data_ptr()
    del dirty
    clean = mp.zeros(1000)
    assert clean.data_ptr() == address  # same pooled block, handed out again
    assert clean.eq(0).all()


@pytest.mark.parametrize("bad", [(-1,), (2.5,), ("3",), (True,)])
def test_bad_sizes_are_value_errors(bad):
    with pytest.raises(ValueError, match="non-negative integers"):
        mp.empty(*bad)


def test_arrays():
    a = mp.empty_array((4, 5), "int32")
    assert a.shape == (4, 5) and a.dtype == np.int32 and mp.is_shared(a)
    z = mp.zeros_array(10)
    assert (z == 0).all() and z.dtype == np.float64
    assert mp.empty_array(0).size == 0
    with pytest.raises(ValueError, match="Python objects"):
        mp.empty_array(3, object)


def test_share_moves_modules_state_dicts_and_lists_in_place():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    weight = model[0].weight
    view = weight[1]
    assert mp.share_(model) is model
    assert all(mp.is_shared(t) for t in model.state_dict().values())
    assert view.data_ptr() == weight.data_ptr() + weight.stride(0) * weight.element_size()
    state = {"a": torch.ones(3), "b": [torch.zeros(2), (torch.arange(4),)]}
    mp.share_(state)
    assert mp.is_shared(state["a"]) and mp.is_shared(state["b"][1][0])
    with pytest.raises(TypeError, match="got int"):
        mp.share_(3)


def test_blocks_recycle_when_the_last_holder_anywhere_drops_them(ctx):
    q = ctx.SimpleQueue()  # first: the queue's ring is an arena block too
    stats = mp.memory_stats()
    block = _C.allocate(4096)
    handle = block.share()
    assert block.refcount == 2
    p = ctx.Process(target=_workers.drop_block_handle, args=(handle, q))
    p.start()
    # One counted reference per process: the child's (forked, it already had one by
    # inheritance, and the handle's extra one was dropped).
    assert q.get() == 2
    p.join(60)
    assert p.exitcode == 0 and block.refcount == 1  # ...and dropped it on exit
    address = block.address
    del block
    assert mp.memory_stats()["live_blocks"] == stats["live_blocks"]
    assert _C.allocate(4096).address == address
    q.close()


def test_size_classes():
    assert _C.class_size(1) == 512
    assert _C.class_size(5000) == 8192
    big = _C.class_size(100 << 20)
    assert 100 << 20 <= big <= (100 << 20) * 1.13 and big % 4096 == 0


def test_empty_cache_returns_memory():
    t = mp.empty(1 << 20)
    del t
    assert mp.empty_cache() >= 4 << 20
    assert mp.memory_stats()["cached_free_bytes"] == 0


def test_numpy_arrays_born_in_blocks_are_sent_without_copies():
    # Note [Arrays born shared]: numpy's handler for this thread only, 64 KiB and up.
    import gc
    import threading

    from torch_mp_ext.sharing import memory as _memory
    from torch_mp_ext.sharing.pickling import dumps, loads

    assert _memory.numpy_in_blocks(True)
    try:
        big, small = np.ones((256, 1024)), np.ones(10)
        assert mp.is_shared(big) and not mp.is_shared(small)
        zeros = np.zeros((300, 1000))  # calloc: zero even in a recycled block
        assert mp.is_shared(zeros) and not zeros.any()
        grown = np.fromiter(range(100_000), dtype=np.float64)  # realloc while it grows
        assert mp.is_shared(grown) and grown.sum() == sum(range(100_000))
        received = loads(dumps(big))
        assert received.__array_interface__["data"][0] == big.__array_interface__["data"][0]
        other = []
        thread = threading.Thread(target=lambda: other.append(mp.is_shared(np.ones((256, 1024)))))
        thread.start()
        thread.join(30)
        assert other == [False]  # numpy's handler is per thread (context)
        assert _C.numpy_allocator_blocks() == 3
    finally:
        assert _memory.numpy_in_blocks(False)
    assert not mp.is_shared(np.ones((256, 1024)))
    del big, zeros, grown, received
    gc.collect()
    assert _C.numpy_allocator_blocks() == 0
