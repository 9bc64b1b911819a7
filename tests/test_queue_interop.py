"""Code written for multiprocessing runs on torch_mp_ext's queues: Pool (PyTorch's
test_fd_pool/test_fs_pool), ProcessPoolExecutor and torch's DataLoader."""

from __future__ import annotations

import gc
import time
from concurrent.futures import ProcessPoolExecutor

import _queue_workers as workers
import pytest
import torch
from torch.utils.data import DataLoader

import torch_mp_ext as mp
from torch_mp_ext.queues import Queue, SimpleQueue

REPEATS = 3  # PyTorch's TEST_REPEATS is 30; the leak check runs after every test anyway


@pytest.fixture
def sharing_strategy(request):
    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy(request.param)
    yield request.param
    mp.set_sharing_strategy(old)


@pytest.mark.parametrize("sharing_strategy", ["file_descriptor", "file_system"], indirect=True)
def test_pool_workers_fill_input_tensors_in_place(sharing_strategy):
    """PyTorch's test_fd_pool / test_fs_pool through torch_mp_ext.Pool."""
    for _ in range(REPEATS):
        p = mp.Pool(2)
        assert type(p._inqueue) is SimpleQueue and type(p._outqueue) is SimpleQueue
        buffers = [torch.zeros(2, 2) for _ in range(4)]
        results = p.map(workers.simple_pool_fill, buffers, 1)
        assert len(results) == len(buffers)
        for r in results:
            assert torch.equal(r, torch.ones(2, 2) * 5)
        for b in buffers:
            assert torch.equal(b, torch.ones(2, 2) * 4)
        p.close()
        p.join()


def test_pool_terminate_reclaims_the_queues_its_killed_workers_held():
    """Pool.terminate() (also what `with Pool() as p:` does) SIGTERMs the workers: they cannot
    let go of the queues; the parent reaps them (Note [Ring holders]), so nothing leaks."""
    gc.collect()
    blocks_before = mp.memory_stats()["live_blocks"]
    p = mp.get_context("spawn").Pool(2)
    assert p.map(workers.square, range(50), chunksize=4) == [x * x for x in range(50)]
    assert p.apply_async(workers.square, (7,)).get(timeout=60) == 49
    # Both workers have opened their queues (a worker killed before it unpickles them keeps
    # its holder in flight for ever: only the segment owner's exit reclaims that).
    # A worker opens its inqueue before its outqueue: wait for both (on a loaded machine the
    # second one can come well after the first).
    def holders(pool):
        return [len(q._ring.holder_table()) for q in (pool._inqueue, pool._outqueue)]

    deadline = time.monotonic() + 60
    while min(holders(p)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert holders(p) == [3, 3]
    p.terminate()
    p.join()
    del p
    gc.collect()
    # The rings' blocks went back to the arena: the dead workers' references were dropped.
    assert mp.memory_stats()["live_blocks"] == blocks_before


def test_process_pool_executor_on_our_context():
    with ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as ex:
        assert list(ex.map(workers.square, range(30), timeout=60)) == [x * x for x in range(30)]
        assert ex.submit(workers.simple_pool_fill, torch.zeros(3)).result(timeout=60).sum() == 15


def _batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x["x"], y["x"]) and torch.equal(x["y"], y["y"])
        assert torch.equal(x["z"], y["z"])


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_with_our_context_yields_the_same_batches(method):
    dataset = workers.TensorDataset(37)
    expected = list(DataLoader(dataset, batch_size=4, num_workers=0))
    loader = DataLoader(dataset, batch_size=4, num_workers=2, timeout=60,
                        multiprocessing_context=mp.get_context(method))
    it = iter(loader)
    assert type(it._worker_result_queue) is Queue
    got = list(it)
    del it
    _batches_equal(got, expected)
    # and a second epoch with persistent workers
    loader = DataLoader(dataset, batch_size=5, num_workers=2, timeout=60, shuffle=False,
                        persistent_workers=True, multiprocessing_context=mp.get_context(method))
    for _ in range(2):
        _batches_equal(list(loader), list(DataLoader(dataset, batch_size=5)))
    del loader
