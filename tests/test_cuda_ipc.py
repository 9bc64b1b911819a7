"""The CUDA keep-alive (Note [CUDA lifetimes]) through real processes, without a GPU.

The bookkeeping runs exactly as with CUDA -- counter files, slots claimed and released by
receiver processes, reclamation after SIGKILL, forwarding, the exit wait -- on the FakeCuda
backend of ``_cuda_workers``, which stands in for torch's CUDA calls. tests/test_cuda.py runs
the same paths on a GPU.
"""

from __future__ import annotations

import os
import signal
import time

import _cuda_workers
import pytest
import torch

import torch_mp_ext as mp
import torch_mp_ext.cuda
from torch_mp_ext import _C, reductions
from torch_mp_ext.cuda import ipc as _cuda_ipc
from torch_mp_ext.cuda.backend import TorchCuda
from torch_mp_ext.cuda.lender import settings


@pytest.fixture
def fake(monkeypatch):
    """FakeCuda in this process, background collection off (tests collect explicitly)."""
    monkeypatch.setattr(settings, "collect_interval_s", 3600.0)
    fake = _cuda_workers.install_fake()
    yield fake
    _cuda_ipc.collect()
    stats = _cuda_ipc.stats()
    _cuda_ipc.set_backend(TorchCuda())
    assert stats["lent_blocks"] == stats["forwarded_blocks"] == stats["counter_files"] == 0, stats
    assert stats["held_slots"] == stats["received_storages"] == 0, stats


@pytest.fixture
def ctx():
    return mp.get_context("fork")  # workers install FakeCuda themselves; fork is fast


def _slot_state(payload):
    """(count, holder key) of the slot a payload names, read through this process's file."""
    ticket, slot = payload[4], payload[5]
    counters = _cuda_ipc._lender.files[ticket[1]]
    return counters.value(slot), counters.holder(slot)


def test_a_send_lives_until_its_receiver_drops_it_then_the_file_goes(fake, ctx):
    storage = torch.UntypedStorage(4096)
    payload = _cuda_ipc.send(storage)
    name = payload[4][1]
    assert os.path.exists("/dev/shm" + name) and name.startswith(f"/torch_{os.getpid()}_")
    assert fake.shared == 1 and _cuda_ipc.stats()["lent_bytes"] == 4096
    q, release = ctx.SimpleQueue(), ctx.Event()
    p = ctx.Process(target=_cuda_workers.receive_and_hold, args=(payload, q, release))
    p.start()
    pid, key, opened = q.get()
    assert pid == p.pid and opened == 1 and _slot_state(payload) == (1, key)
    del storage  # the producer's own storage going changes nothing: B still uses the block
    assert _cuda_ipc.collect() == 0 and fake.native_released == []
    release.set()
    assert q.get() == ("released", 1)  # B synchronised its stream, then released
    assert _slot_state(payload)[0] == 0
    assert _cuda_ipc.collect() == 1
    assert fake.native_released == [("native", 1)] and fake.native_collects == 1
    assert not os.path.exists("/dev/shm" + name)  # every slot back: the file is dropped
    p.join(60)
    q.close()


def test_a_receiver_sigkilled_while_holding_is_reclaimed(fake, ctx):
    payload = _cuda_ipc.send(torch.UntypedStorage(100))
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_cuda_workers.receive_and_hang, args=(payload, q))
    p.start()
    assert q.get() == p.pid
    assert _cuda_ipc.collect() == 0
    os.kill(p.pid, signal.SIGKILL)
    p.join(60)
    assert _slot_state(payload)[0] == 1  # never released...
    assert _cuda_ipc.collect() == 1  # ...but reclaimed: its holder is dead
    assert _cuda_ipc.stats()["reclaimed_slots"] >= 1 and len(fake.native_released) == 1
    q.close()


def test_a_receiver_exiting_while_holding_releases_at_exit(fake, ctx):
    payload = _cuda_ipc.send(torch.UntypedStorage(100))
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_cuda_workers.receive_then_exit, args=(payload, q))
    p.start()
    assert q.get() == 100
    p.join(60)
    assert p.exitcode == 0 and _slot_state(payload)[0] == 0  # released, not reclaimed
    assert _cuda_ipc._lender.collect(check_holders=False, drop_files=True) == 1
    q.close()


def test_a_block_received_twice_is_one_storage_and_one_slot(fake, ctx):
    storage = torch.UntypedStorage(64)
    first, second = _cuda_ipc.send(storage), _cuda_ipc.send(storage)
    assert first[4][4] != second[4][4]  # two sends, two tags (each its own torch keep-alive)
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_cuda_workers.receive_twice, args=(first, second, q))
    p.start()
    same, opened, waited, stats = q.get()
    assert same and opened == 1 and waited == 2  # the second receipt still waits its event
    assert stats["held_slots"] == 1 and stats["received_storages"] == 1  # 2nd slot given back
    p.join(60)
    assert _slot_state(first)[0] == _slot_state(second)[0] == 0
    assert _cuda_ipc.collect() == 2 and len(fake.native_released) == 2
    q.close()


def test_a_round_trip_in_one_process_is_the_same_storage(fake):
    released = _cuda_ipc.stats()["released_blocks"]
    storage = torch.UntypedStorage(64)
    payload = _cuda_ipc.send(storage)
    back = _cuda_ipc.receive(*payload)
    assert back._cdata == storage._cdata and fake.opened == 0 and fake.events_waited == 0
    assert _slot_state(payload)[0] == 0
    _cuda_ipc.collect()  # counted here, or already by the collector thread of an earlier
    # test still waiting out its short interval (seen once under load)
    assert _cuda_ipc.stats()["released_blocks"] == released + 1


def test_a_forwarded_block_lives_until_the_third_process_drops_it(fake, ctx):
    payload = _cuda_ipc.send(torch.UntypedStorage(2048))
    out, done = ctx.SimpleQueue(), ctx.Event()
    b = ctx.Process(target=_cuda_workers.receive_and_forward, args=(payload, out, done))
    b.start()
    forwarded = out.get()
    ticket, fticket = payload[4], forwarded[4]
    assert fticket[1:3] == ticket[1:3] and fticket[4] == ticket[4]  # A's file, A's tag
    assert forwarded[5] != payload[5] and fticket[6] == b.pid and forwarded[1] == payload[1]
    q, release = ctx.SimpleQueue(), ctx.Event()
    c = ctx.Process(target=_cuda_workers.receive_and_hold, args=(forwarded, q, release))
    c.start()
    _, c_key, _ = q.get()
    done.set()
    assert out.get() == ("forwarder done", 1)  # B recorded an event for C
    b.join(60)
    assert b.exitcode == 0  # B did not wait at exit: C had claimed its slot (used the event)
    assert _slot_state(payload)[0] == 0 and _slot_state(forwarded) == (1, c_key)
    assert _cuda_ipc.collect() == 0 and fake.native_released == []  # C still holds A's block
    release.set()
    assert q.get()[0] == "released"
    assert _cuda_ipc.collect() == 1 and len(fake.native_released) == 1
    c.join(60)
    out.close()
    q.close()


def test_exit_waits_then_warns_with_blocks_bytes_and_holders(fake, tmp_path):
    ctx = mp.get_context("spawn")  # a fresh interpreter: warnings as users see them
    stderr = tmp_path / "stderr"
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_cuda_workers.produce_and_exit, args=(q, 0.5, str(stderr), 3 << 20))
    start = time.monotonic()
    p.start()
    payload = q.get()
    storage = _cuda_ipc.receive(*payload)
    assert q.get() == "sent"
    p.join(60)
    assert p.exitcode == 0 and time.monotonic() - start >= 0.5
    text = stderr.read_text()
    assert "CudaSharingWarning" in text and f"process {p.pid} is exiting" in text
    assert "1 CUDA block(s) (3.0 MiB)" in text and f"process {os.getpid()} (1 block)" in text
    assert "set_exit_wait" in text and "clones" in text
    assert not os.path.exists("/dev/shm" + payload[4][1])  # its counter file went with it
    with pytest.raises(RuntimeError, match=rf"process {p.pid}, which allocated .* Clone"):
        _cuda_ipc.send(storage)  # forwarding what a dead producer lent
    del storage  # releases into the unlinked (still mapped) file, then unmaps it
    assert _cuda_ipc.stats()["mapped_counter_files"] == 0
    q.close()


def test_exit_wait_ends_as_soon_as_the_receiver_releases(fake, ctx, tmp_path):
    stderr = tmp_path / "stderr"
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_cuda_workers.produce_and_exit, args=(q, 30, str(stderr), 1000))
    p.start()
    storage = _cuda_ipc.receive(*q.get())
    assert q.get() == "sent"
    time.sleep(0.3)
    start = time.monotonic()
    del storage
    p.join(60)
    assert p.exitcode == 0 and time.monotonic() - start < 10
    assert "CudaSharingWarning" not in stderr.read_text()
    q.close()


def test_a_payload_arriving_after_its_producer_exited_is_an_error(fake, ctx, tmp_path):
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_cuda_workers.produce_and_exit,
                    args=(q, 0, str(tmp_path / "stderr"), 1000))
    p.start()
    payload = q.get()
    assert q.get() == "sent"
    p.join(60)
    with pytest.raises(RuntimeError, match=rf"after process {p.pid}, which allocated it, had "
                                           r"exited.*send clones"):
        _cuda_ipc.receive(*payload)
    q.close()


def test_a_stale_slot_is_refused(fake):
    storage = torch.UntypedStorage(10)
    payload = _cuda_ipc.send(storage)
    ticket = list(payload[4])
    ticket[3] += 1  # a generation the slot no longer has
    with pytest.raises(RuntimeError, match="stale message"):
        _cuda_ipc.receive(*payload[:4], tuple(ticket), *payload[5:])
    assert _cuda_ipc.receive(*payload)._cdata == storage._cdata  # the real one still works


def test_tensors_through_the_reducers_and_views_keep_the_slot(fake, ctx):
    q, done = ctx.SimpleQueue(), ctx.Event()
    p = ctx.Process(target=_cuda_workers.produce_tensor_and_wait, args=(q, done))
    p.start()
    row_args, param_args, empty_args = q.get()
    t = reductions.rebuild_cuda_tensor(*row_args)
    param = reductions.rebuild_cuda_tensor(*param_args)
    empty = reductions.rebuild_cuda_tensor(*empty_args)
    assert t.shape == (2, 4) and t.stride() == (4, 1) and t.storage_offset() == 4
    assert type(param) is torch.nn.Parameter and param.dtype == torch.int64
    assert not param.requires_grad and empty.numel() == 0
    assert _cuda_ipc.stats()["held_slots"] == 2
    view = t[1:]
    t.untyped_storage()  # a fresh Python storage object on the same storage changes nothing
    del t
    assert _cuda_ipc.stats()["held_slots"] == 2  # a view still uses the storage
    del view, param
    assert _cuda_ipc.stats()["held_slots"] == 0
    done.set()
    stats = q.get()
    assert stats["lent_blocks"] == 0 and stats["released_blocks"] == 2
    p.join(60)
    q.close()


def test_forked_copies_of_received_storages_release_nothing(fake, ctx):
    storage = torch.UntypedStorage(64)
    payload = _cuda_ipc.send(storage)
    # Received from "elsewhere": forget that this process is the producer.
    _cuda_ipc._cache.clear()
    own_key = payload[4][5]
    ticket = payload[4][:5] + (own_key + 1,) + payload[4][6:]
    received = [_cuda_ipc.receive(*payload[:4], ticket, *payload[5:])]
    assert _slot_state(payload)[0] == 1
    q = ctx.SimpleQueue()
    child = ctx.Process(target=_cuda_workers.drop_inherited_and_exit, args=(q, received))
    child.start()
    assert q.get() == "dropped"
    child.join(60)
    assert _slot_state(payload)[0] == 1  # the child's copy released nothing
    received.clear()
    assert _slot_state(payload)[0] == 0
    q.close()


def test_the_collector_thread_releases_without_being_asked(fake, ctx, monkeypatch):
    monkeypatch.setattr(settings, "collect_interval_s", 0.02)
    payload = _cuda_ipc.send(torch.UntypedStorage(100))
    q, release = ctx.SimpleQueue(), ctx.Event()
    p = ctx.Process(target=_cuda_workers.receive_and_hold, args=(payload, q, release))
    p.start()
    q.get()
    release.set()
    q.get()
    deadline = time.monotonic() + 10
    while fake.native_released == [] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(fake.native_released) == 1 and _cuda_ipc.stats()["counter_files"] == 0
    p.join(60)
    q.close()


def test_torch_format_payloads_go_to_torch(monkeypatch):
    seen = []
    monkeypatch.setattr(reductions._torch_reductions, "rebuild_cuda_tensor",
                        lambda *args: seen.append(args) or "torch's")
    args = (torch.Tensor, (2,), (1,), 0, torch.storage.TypedStorage, torch.float32, 0,
            b"h" * 64, 8, 0, False, b"/torch_1_2", 3, b"e" * 64, True)
    assert reductions.rebuild_cuda_tensor(*args) == "torch's" and seen == [args]


def test_exit_wait_setting():
    before = torch_mp_ext.cuda.get_exit_wait()
    assert before == (10.0, 2.0)  # the defaults
    try:
        torch_mp_ext.cuda.set_exit_wait(None, unreceived=None)
        assert torch_mp_ext.cuda.get_exit_wait() == (None, None)
        torch_mp_ext.cuda.set_exit_wait(3)
        assert torch_mp_ext.cuda.get_exit_wait() == torch_mp_ext.cuda.ExitWait(3.0, 2.0)
        for bad in (-1, "10", float("nan"), True):
            with pytest.raises(ValueError, match="seconds >= 0 or None"):
                torch_mp_ext.cuda.set_exit_wait(bad)
    finally:
        torch_mp_ext.cuda.set_exit_wait(*before)
    assert torch_mp_ext.cuda.ipc_collect() == 0
    assert set(torch_mp_ext.cuda.ipc_stats()) >= {"lent_blocks", "held_slots"}
    assert _C.holder_key() >> 32 == os.getpid()


def test_an_unreceived_block_holds_an_exit_for_the_unreceived_wait_only(fake, tmp_path):
    ctx = mp.get_context("spawn")  # a fresh interpreter: warnings as users see them
    stderr = tmp_path / "stderr"
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_cuda_workers.lend_to_nobody_and_exit, args=(q, str(stderr)))
    start = time.monotonic()
    p.start()
    assert q.get() == "lent"
    lent = time.monotonic()
    p.join(60)
    end = time.monotonic()
    # At least the 0.5 s wait for unreceived blocks; far less than the 30 s exit wait, timed
    # from "lent" so that the spawn start (seconds on a loaded machine) does not count.
    assert p.exitcode == 0 and end - start >= 0.5 and end - lent < 10, (start, lent, end)
    text = stderr.read_text()
    assert "1 CUDA block(s) (1000 bytes)" in text and "no process yet (not received)" in text
    q.close()
