"""A TaskPool nobody is waiting on, and a caller blocked on a slow task, cost no CPU: the
pool's threads and the caller sleep on the result queue's ring and the workers' sentinels
(Note [Who reads the result queue] in ``tasks/pool.py``), never in timed polls."""

from __future__ import annotations

import os
import threading
import time

import _task_workers as tw
import pytest

import torch_mp_ext as mp

T = 30.0  # seconds: the most any single wait in these tests may take


def _cpu_s():
    t = os.times()
    return t.user + t.system


def _switches():
    """Context switches so far of the main thread and the pool's threads: each is a wake-up
    (the pytest harness's own threads are left out: they are not under test)."""
    total = 0
    ids = [threading.main_thread().native_id] + [
        th.native_id for th in threading.enumerate() if th.name.startswith("TaskPool")]
    for tid in ids:
        with open(f"/proc/self/task/{tid}/status") as f:
            for line in f:
                if "ctxt_switches" in line:  # voluntary and nonvoluntary
                    total += int(line.split()[-1])
    return total


@pytest.mark.slow  # 5 s of waiting on purpose: measuring what idling costs takes idling
def test_an_idle_pool_and_a_blocked_caller_cost_no_cpu():
    with mp.TaskPool(2, start_method="fork") as pool:
        assert pool.submit(tw.add, 1, 2).get(timeout=T) == 3  # the workers are up
        s0, c0 = _switches(), _cpu_s()
        time.sleep(2.0)
        idle = _switches() - s0, _cpu_s() - c0
        ref = pool.submit(tw.sleep_then, 3.0, "done")
        s0, c0 = _switches(), _cpu_s()
        assert ref.get(timeout=T) == "done"
        blocked = _switches() - s0, _cpu_s() - c0
    # Polling every 20 ms woke the pool ~100 times in 2 s, and 150-600 times while the caller
    # waited 3 s. What remains is the ring's blocked get returning every 200 ms so that Python
    # can run signal handlers (WAIT_SLICE_S in csrc/queue/ring.cpp: ~10 in 2 s, ~15 in 3 s),
    # the submit and the result; the bounds leave room for a loaded machine, not for a poll.
    assert idle[0] < 30, f"an idle pool woke {idle[0]} times in 2 s"
    assert blocked[0] < 60, f"a caller blocked on a 3 s task woke {blocked[0]} times"
    assert idle[1] < 0.05 and blocked[1] < 0.05, (idle, blocked)


def test_callers_in_many_threads_hand_the_result_queue_over_without_losing_a_wakeup():
    """Callers in four threads wait at once; whoever reads the result queue hands it over
    (Note [Who reads the result queue]). A caller that went to sleep on STATE just after
    the pump came free would wait for a value nobody read, until its timeout."""
    errors = []

    def caller(pool, base):
        try:
            for i in range(1500):
                assert pool.submit(tw.add, base, i).get(timeout=T) == base + i
        except Exception as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    with mp.TaskPool(2, start_method="fork") as pool:
        threads = [threading.Thread(target=caller, args=(pool, 1000 * n)) for n in range(4)]
        start = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join(2 * T)
        elapsed = time.monotonic() - start
    assert not errors and not any(th.is_alive() for th in threads), errors
    # 6,000 round trips of ~50-100 us each; 10 s is a loaded machine, a lost wake-up is 30 s.
    assert elapsed < 10.0, elapsed


def test_a_task_waiting_for_another_pools_ref_starts_when_that_pool_fills_it():
    """The ref is filled by the other pool's reader; with nothing polling, that reader must
    dispatch the waiting task on its own pool (Note [Who reads the result queue])."""
    with mp.TaskPool(1, start_method="fork") as first, \
            mp.TaskPool(1, start_method="fork") as second:
        a = first.submit(tw.sleep_then, 0.3, 5)
        b = second.submit(tw.add, a, 1)
        assert b.get(timeout=T) == 6
