"""CUDA tensors across processes on a real GPU (Note [CUDA lifetimes]).

Every test here needs a CUDA GPU and skips without one; tests/test_cuda_ipc.py runs the same
keep-alive bookkeeping without a GPU, and tools/gpu_check.py is the fuller GPU run (PyTorch's
CUDA multiprocessing cases, 10,000 sends, and the hand-off benchmark against torch).
"""

from __future__ import annotations

import os

import _cuda_workers
import pytest
import torch

import torch_mp_ext as mp
import torch_mp_ext.cuda

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False here); the same keep-alive "
    "logic runs without one in tests/test_cuda_ipc.py, and tools/gpu_check.py runs these "
    "paths on a GPU machine",
)


@pytest.fixture
def ctx():
    return mp.get_context("spawn")


@pytest.fixture(autouse=True)
def _collect_after():
    yield
    torch_mp_ext.cuda.ipc_collect()
    stats = torch_mp_ext.cuda.ipc_stats()
    assert stats["lent_blocks"] == stats["counter_files"] == stats["held_slots"] == 0, stats


def test_receivers_write_through_and_rebuild_one_storage(ctx):
    x = torch.zeros(5, 5, device="cuda")
    data = [x, x[:, 1]]
    q, done = ctx.Queue(), ctx.Event()
    q.put(data)
    p = ctx.Process(target=_cuda_workers.cuda_fill, args=(q, done))
    p.start()
    assert done.wait(120)
    assert data[0].eq(4).all() and data[1].eq(4).all()
    p.join(60)
    assert p.exitcode == 0
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_cuda_workers.cuda_send_twice, args=(q, done))
    p.start()
    t1, t2 = q.get(timeout=120), q.get(timeout=60)
    assert t1.eq(1).all() and t1.untyped_storage()._cdata == t2.untyped_storage()._cdata
    del t1, t2
    done.set()
    p.join(60)
    assert p.exitcode == 0


def test_a_producer_may_drop_what_it_sent(ctx):
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_cuda_workers.cuda_send_and_delete, args=(q, done, 5))
    p.start()
    got = [q.get(timeout=120) for _ in range(5)]
    for i, t in enumerate(got):
        assert t.equal(torch.full([5], i, device="cuda", dtype=torch.int32))
    del got, t
    done.set()
    p.join(60)
    assert p.exitcode == 0


def test_the_receiver_waits_on_the_sender_event(ctx):
    q, ready, done = ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=_cuda_workers.cuda_multiply_two, args=(q, ready, done))
    p.start()
    assert ready.wait(120)
    with torch.cuda.stream(torch.cuda.Stream()):
        tensor = torch.ones(4, device="cuda")
        event = torch.cuda.Event(interprocess=True)
        torch.cuda._sleep(20_000_000)  # without the event, the child would multiply first
        tensor.add_(1)
        event.record()
        q.put((event, tensor))
        assert done.wait(60)
        event.synchronize()
        assert tensor.tolist() == [4, 4, 4, 4]
    p.join(60)


def test_a_received_tensor_can_be_sent_on_and_outlives_the_forwarder(ctx):
    t = torch.full((1000,), 2.0, device="cuda")
    q_ab, q_bc, q_c = ctx.Queue(), ctx.Queue(), ctx.Queue()
    done_b, release_c = ctx.Event(), ctx.Event()
    b = ctx.Process(target=_cuda_workers.cuda_forward, args=(q_ab, q_bc, done_b))
    c = ctx.Process(target=_cuda_workers.cuda_read_write_hold, args=(q_bc, q_c, release_c))
    b.start()
    c.start()
    q_ab.put(t)
    assert q_c.get(timeout=120) == 2000.0
    assert q_c.get(timeout=60) == "written"
    assert t.eq(7).all()  # C wrote into A's memory through B's forward
    done_b.set()
    b.join(60)
    assert b.exitcode == 0
    del t  # A's own tensor goes too: only C keeps the block alive now
    torch_mp_ext.cuda.ipc_collect()
    assert torch_mp_ext.cuda.ipc_stats()["lent_blocks"] == 1
    release_c.set()
    assert q_c.get(timeout=60) == "released"
    c.join(60)


def test_torch_format_specs_rebuild_by_keyword(ctx):
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_cuda_workers.cuda_share_torch_format, args=(q, done))
    p.start()
    spec = q.get(timeout=120)
    t = mp.reductions.rebuild_cuda_tensor(**spec)
    assert t.tolist() == [0, 1, 2, 3, 4, 5]
    del t
    done.set()
    p.join(60)


def test_many_sends_leak_no_gpu_memory(ctx):
    torch.cuda.init()
    before = torch.cuda.memory_allocated()
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_cuda_workers.cuda_sum_and_drop, args=(q_in, q_out, 1000))
    p.start()
    for i in range(1000):
        q_in.put(torch.full((256,), float(i), device="cuda"))
    total, consumer_before, consumer_after = q_out.get(timeout=300)
    assert total == 256 * sum(range(1000)) and consumer_after == consumer_before
    p.join(60)
    torch_mp_ext.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() == before
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{os.getpid()}_")]


def test_mixed_dtypes_from_one_allocation_and_empty_tensors(ctx):
    import pickle
    from multiprocessing.reduction import ForkingPickler

    block = torch.zeros(64, dtype=torch.uint8, device="cuda")
    floats = block[:32].view(torch.float32)
    floats.fill_(1.5)
    for t in (floats, block[32:], torch.empty(0, device="cuda"),
              torch.nn.Parameter(torch.zeros(3, device="cuda", dtype=torch.int64),
                                 requires_grad=False)):
        u = pickle.loads(ForkingPickler.dumps(t))  # in one process: the same storage back
        assert type(u) is type(t) and u.dtype == t.dtype and u.equal(t)
        assert t.numel() == 0 or u.untyped_storage()._cdata == t.untyped_storage()._cdata
