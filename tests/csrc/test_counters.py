"""Counter files as the CUDA keep-alive uses them: tags, claims, snapshot collection."""

from __future__ import annotations

import os
import signal

import _cuda_workers
import _workers

import torch_mp_ext as mp
from torch_mp_ext import _C


def test_collect_reports_a_tag_dead_only_when_its_last_slot_is_released():
    counters = _C.CounterFile.create(8)
    (a, _), (b, _), (c, _) = (counters.acquire(1, 7), counters.acquire(1, 7),
                              counters.acquire(1, 9))
    assert counters.tag(a) == 7 and counters.in_use == 3
    assert counters.collect() == (True, [], [], 0)
    counters.add(a, -1)
    assert counters.collect() == (True, [], [], 1)  # slot a recycled, tag 7 still held by b
    counters.add(b, -1)
    assert counters.collect() == (True, [7], [], 1)
    assert counters.in_use == 1 and counters.tag(a) == 0
    assert [(s, t, n) for s, t, n, _ in counters.counted_slots()] == [(c, 9, 1)]
    counters.add(c, -1)
    assert counters.collect(False) == (True, [9], [], 1) and counters.in_use == 0
    assert counters.unlink()


def test_untagged_slots_are_left_to_their_owner():
    counters = _C.CounterFile.create(2)
    slot, _ = counters.acquire(1)
    counters.add(slot, -1)
    assert counters.collect() == (True, [], [], 0) and counters.in_use == 1
    counters.recycle(slot)
    assert counters.unlink()


def test_claim_refuses_a_stale_generation_and_records_the_holder():
    counters = _C.CounterFile.create(2)
    slot, generation = counters.acquire(1, 3)
    assert not counters.claim(slot, generation + 1) and counters.holder(slot) == 0
    assert counters.claim(slot, generation) and counters.holder(slot) == _C.holder_key()
    counters.add(slot, -1)
    counters.collect()
    assert counters.unlink()


def test_slots_of_a_sigkilled_holder_are_reclaimed_with_their_tag():
    counters = _C.CounterFile.create(4)
    slot, _ = counters.acquire(1, 11)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_workers.counter_hold_forever,
                    args=(counters.name, counters.segment_id, slot, q))
    p.start()
    assert q.get() == "holding"
    assert counters.collect() == (True, [], [], 0)  # holder alive: still counted
    os.kill(p.pid, signal.SIGKILL)
    p.join(60)
    stable, dead, reclaimed, recycled = counters.collect(check_holders=False)
    assert (dead, reclaimed) == ([], [])  # without holder checks the count is all that counts
    stable, dead, reclaimed, recycled = counters.collect()
    assert stable and dead == [11] and recycled == 1
    assert reclaimed == [(slot, reclaimed[0][1], 11)] and reclaimed[0][1] >> 32 == p.pid
    assert counters.in_use == 0 and counters.unlink()
    q.close()


def test_a_tag_moving_between_slots_is_never_seen_dead():
    """A forwarder keeps a tag referenced while moving it between slots; collect() running
    concurrently must never report the tag dead (Note [Counter snapshots])."""
    counters = _C.CounterFile.create(32)
    first, _ = counters.acquire(1, 5)
    ctx = mp.get_context("spawn")
    q, finish = ctx.SimpleQueue(), ctx.Event()
    p = ctx.Process(target=_cuda_workers.forward_chain,
                    args=(counters.name, counters.segment_id, 5, first, 1.5, q, finish))
    p.start()
    stable_runs, seen_dead = 0, []
    while q.empty():
        stable, dead, _, _ = counters.collect(False)
        seen_dead += dead
        stable_runs += stable
    moves = q.get()
    finish.set()
    p.join(60)
    stable, dead, _, _ = counters.collect(False)
    assert stable and dead == [5] and counters.in_use == 0
    assert counters.unlink()
    q.close()
    assert seen_dead == [], "tag 5 was reported dead while still referenced"
    assert moves > 100 and stable_runs > 10


def test_a_holder_whose_pid_was_reused_is_dead_and_its_slot_reclaimed():
    # Note [Process identity]: this process's pid with another start time is a dead process
    # whose pid the kernel handed to us. Its slot must be reclaimed, ours must not.
    counters = _C.CounterFile.create(2)
    (mine, _), (reused, _) = counters.acquire(1, 5), counters.acquire(1, 6)
    me = _C.holder_key()
    impostor = (me & ~0xFFFFFFFF) | ((me + 1) & 0xFFFFFFFF)
    counters.set_holder(mine, me)
    counters.set_holder(reused, impostor)
    assert counters.holder_alive(mine) and not counters.holder_alive(reused)
    assert counters.collect(True) == (True, [6], [(reused, impostor, 6)], 1)
    assert counters.value(mine) == 1 and counters.tag(mine) == 5  # the live holder's: kept
    counters.add(mine, -1)
    counters.collect()
    assert counters.unlink()
