"""torch_mp_ext.ArrayQueue: a pool of blocks shaped like a template, slots recycled across
processes, zero-copy gets and puts, errors naming both shapes."""

from __future__ import annotations

import gc
import pickle
import queue

import _pipeline_workers as w
import numpy as np
import pytest
import torch

import torch_mp_ext as mp

T = 30  # every blocking call here has a timeout


def wait_free(aq, expected):
    for _ in range(200):
        gc.collect()
        if aq.free_blocks() == expected:
            return True
        import time

        time.sleep(0.02)
    return False


def test_arrays_come_back_as_views_and_their_blocks_return_to_the_pool():
    aq = mp.ArrayQueue(np.zeros((4, 5)), maxsize=3)
    aq.put(np.arange(20.0).reshape(4, 5), timeout=T)
    aq.put({"not": "an array"}, timeout=T)
    assert (aq.qsize(), aq.free_blocks()) == (2, 2)
    x = aq.get(timeout=T)
    assert x.sum() == 190.0 and mp.is_shared(x) and x.shape == (4, 5)
    assert aq.get(timeout=T) == {"not": "an array"}
    view = x[1:]
    del x
    assert aq.free_blocks() == 2  # a view still uses the block
    del view
    assert wait_free(aq, 3)


def test_recycling_keeps_to_the_pool_however_many_arrays_pass():
    aq = mp.ArrayQueue(np.zeros(100_000), maxsize=2)
    before = mp.memory_stats()["live_blocks"]
    for i in range(50):
        aq.put(np.full(100_000, float(i)), timeout=T)
        assert aq.get(timeout=T)[0] == float(i)
    assert mp.memory_stats()["live_blocks"] == before and aq.free_blocks() == 2


def test_put_of_a_slot_array_copies_nothing():
    aq = mp.ArrayQueue(np.zeros((8, 8), np.float32), maxsize=2)
    a = aq.new_array(timeout=T)
    a[...] = 3
    address = a.__array_interface__["data"][0]
    aq.put(a, timeout=T)
    assert aq.free_blocks() == 1  # handed on: dropping `a` does not free it
    del a
    gc.collect()
    assert aq.free_blocks() == 1
    b = aq.get(timeout=T)
    assert b.__array_interface__["data"][0] == address and b[0, 0] == 3
    aq.put(b, timeout=T)  # forwarding a received array: no copy either
    c = aq.get(timeout=T)
    assert c.__array_interface__["data"][0] == address
    del b, c
    assert wait_free(aq, 2)


def test_wrong_arrays_and_templates_raise_naming_both():
    aq = mp.ArrayQueue(np.zeros((500, 2000)), maxsize=1)
    with pytest.raises(ValueError, match=r"shape \(500, 2000\) and dtype float64.*"
                                         r"got shape \(500, 200\) and dtype float64"):
        aq.put(np.zeros((500, 200)))
    with pytest.raises(ValueError, match="dtype float64.*dtype float32"):
        aq.put(torch.zeros(500, 2000, dtype=torch.float32))
    with pytest.raises(TypeError, match="numpy array or a CPU tensor"):
        mp.ArrayQueue([1, 2, 3], 2)
    with pytest.raises(ValueError, match="maxsize"):
        mp.ArrayQueue(np.zeros(3), 0)
    with pytest.raises(ValueError, match="Python objects"):
        mp.ArrayQueue(np.zeros(3, dtype=object), 1)
    assert aq.free_blocks() == 1 and aq.empty()  # nothing was taken by the failed puts


def test_timeouts_when_every_block_is_held():
    aq = mp.ArrayQueue(np.zeros(10), maxsize=1)
    aq.put(np.ones(10), timeout=T)
    with pytest.raises(queue.Full, match="no free block"):
        aq.put(np.ones(10), timeout=0.1)
    held = aq.get(timeout=T)
    with pytest.raises(queue.Full):
        aq.new_array(block=False)
    with pytest.raises(queue.Empty):
        aq.get(timeout=0.1)
    del held
    assert wait_free(aq, 1)
    aq.put("small things still pass", timeout=T)


def test_tensor_templates_return_tensors():
    aq = mp.ArrayQueue(torch.zeros(3, 4, dtype=torch.bfloat16), maxsize=2)
    aq.put(torch.ones(3, 4, dtype=torch.bfloat16), timeout=T)
    t = aq.get(timeout=T)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.sum().item() == 12
    assert mp.is_shared(t)
    floats = mp.ArrayQueue(torch.zeros(2, 2), maxsize=1)
    floats.put(np.ones((2, 2), np.float32), timeout=T)  # same dtype name: accepted
    assert torch.equal(floats.get(timeout=T), torch.ones(2, 2))


@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "new_array"])
def test_across_processes_slots_recycle(ctx, in_place):
    aq = mp.ArrayQueue(np.zeros((64, 1024)), maxsize=3)
    results = ctx.Queue()
    producer = ctx.Process(target=w.aq_produce, args=(aq, 40, in_place))
    consumer = ctx.Process(target=w.aq_consume, args=(aq, results))
    producer.start()
    consumer.start()
    got = [results.get(timeout=T) for _ in range(41)]
    producer.join(T)
    consumer.join(T)
    assert (producer.exitcode, consumer.exitcode) == (0, 0)
    assert got == [(float(i), True) for i in range(40)] + ["done"]
    assert wait_free(aq, 3)  # every block came back, whichever process dropped it


def test_pickles_into_a_pipeline_stage():
    with_pipeline = list(mp.pipeline(w.arrays(5, (64, 1024)), w.aq_stage))
    assert with_pipeline == [2.0 * i for i in range(5)]
    aq = mp.ArrayQueue(np.zeros(4), 1)
    clone = pickle.loads(pickle.dumps(aq))
    clone.put(np.ones(4), timeout=T)
    assert aq.get(timeout=T).sum() == 4
