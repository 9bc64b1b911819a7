"""TaskPool: the seed's examples (Ray's dynamic generators page) on torch_mp_ext's API, plus
streaming with back-pressure and cancellation, count mismatches, killed workers, and refs
freed when dropped. Real worker processes; every blocking call has a timeout."""

from __future__ import annotations

import os
import signal
import threading
import time

import _task_workers as tw
import numpy as np
import pytest

import torch_mp_ext as mp
from torch_mp_ext.errors import (
    GetTimeoutError,
    PoolClosedError,
    RemoteTaskError,
    RemoteTraceback,
    ReturnCountError,
    TaskCancelledError,
    WorkerDiedError,
)

T = 30.0  # seconds: the most any single wait in these tests may take


@pytest.fixture(scope="module")
def pool():
    with mp.TaskPool(2) as p:
        yield p


def wait_until(predicate, timeout=T):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


# ---- the seed, section by section ----------------------------------------------------------


def test_num_returns_set_by_caller_list_and_generator(pool):
    a, b, c = pool.submit(tw.large_values, 3, 1000, num_returns=3)
    assert [x.shape for x in mp.get([a, b, c], timeout=T)] == [(1000, 1)] * 3
    refs = pool.submit(tw.large_values_generator, 3, 1000, num_returns=3)
    assert len(refs) == 3
    values = mp.get(refs, timeout=T)
    assert all(v.dtype == np.int8 and v.shape == (1000, 1) for v in values)


def test_num_returns_set_by_executor_dynamic(pool):
    array_ref = pool.put(np.zeros(np.random.randint(10_000, 50_000)))
    block_size = 1000
    dynamic_ref = pool.submit(tw.split, array_ref, block_size, num_returns="dynamic")
    assert isinstance(dynamic_ref, mp.Ref)
    ref_generator = dynamic_ref.get(timeout=T)
    assert isinstance(ref_generator, mp.RefGenerator)
    num_blocks_generated = 0
    for ref in ref_generator:
        assert len(mp.get(ref, timeout=T)) <= block_size
        num_blocks_generated += 1
    array_size = len(mp.get(array_ref))
    assert array_size <= num_blocks_generated * block_size
    assert num_blocks_generated == -(-array_size // block_size)
    del dynamic_ref


def test_passing_dynamic_ref_and_ref_generator_to_another_task(pool):
    array_ref = pool.put(np.zeros(12_345))
    dynamic_ref = pool.submit(tw.split, array_ref, 1000, num_returns="dynamic")
    # The worker receives the RefGenerator and reads each value itself.
    assert pool.submit(tw.get_size, dynamic_ref, 1000).get(timeout=T) == 12_345
    ref_generator = dynamic_ref.get(timeout=T)  # works too, at the cost of a get here
    assert pool.submit(tw.get_size, ref_generator, 1000).get(timeout=T) == 12_345


def test_exception_fixed_num_returns(pool):
    ref1, ref2, ref3, ref4 = pool.submit(tw.generator, num_returns=4)
    assert mp.get([ref1, ref2], timeout=T) == [0, 1]
    for ref in (ref3, ref4):
        with pytest.raises(Exception, match="error") as info:
            mp.get(ref, timeout=T)
        assert type(info.value) is Exception
        assert isinstance(info.value.__cause__, RemoteTraceback)
        assert "in generator" in str(info.value.__cause__)


def test_exception_dynamic_is_an_extra_final_ref(pool):
    dynamic_ref = pool.submit(tw.generator, num_returns="dynamic")
    ref1, ref2, ref3 = dynamic_ref.get(timeout=T)
    assert mp.get([ref1, ref2], timeout=T) == [0, 1]
    with pytest.raises(Exception, match="error"):
        mp.get(ref3, timeout=T)


def test_exception_streaming_is_raised_at_its_position(pool):
    gen = pool.submit(tw.generator, num_returns="streaming")
    assert gen.next(timeout=T).get(timeout=T) == 0
    assert gen.next(timeout=T).get(timeout=T) == 1
    with pytest.raises(Exception, match="error") as info:
        gen.next(timeout=T)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    with pytest.raises(StopIteration):
        gen.next(timeout=T)


def test_too_many_yields_raise_on_the_callers_side(pool):
    # The seed's known bug (ray#28689): Ray only logs this. Here the last ref holds the error.
    ref1, ref2 = pool.submit(tw.count, 5, num_returns=2)
    assert ref1.get(timeout=T) == 0
    with pytest.raises(ReturnCountError, match="yielded more than num_returns=2") as info:
        ref2.get(timeout=T)
    assert (info.value.expected, info.value.produced) == (2, 3)
    # The seed's exact case: all values yielded, then an exception: not lost either.
    ref1, ref2 = pool.submit(tw.generator, num_returns=2)
    assert ref1.get(timeout=T) == 0
    with pytest.raises(Exception, match="error"):
        ref2.get(timeout=T)


def test_too_few_yields_fill_the_missing_refs(pool):
    refs = pool.submit(tw.count, 2, num_returns=4)
    assert mp.get(refs[:2], timeout=T) == [0, 1]
    for ref in refs[2:]:
        with pytest.raises(ReturnCountError, match="num_returns=4 but produced 2") as info:
            ref.get(timeout=T)
        assert (info.value.expected, info.value.produced) == (4, 2)


def test_function_returning_a_sequence(pool):
    one, two = pool.submit(tw.pair, num_returns=2)
    assert mp.get([one, two], timeout=T) == [1, "two"]
    refs = pool.submit(tw.pair, num_returns=3)
    with pytest.raises(ReturnCountError, match="returned a list of 2 values"):
        refs[0].get(timeout=T)


# ---- streaming -----------------------------------------------------------------------------


def test_streaming_yields_refs_as_produced(pool):
    gen = pool.submit(tw.count, 50, num_returns="streaming")
    assert [ref.get(timeout=T) for ref in gen] == list(range(50))
    assert gen.completed()


def test_streaming_first_value_before_the_generator_ends(pool):
    flag = mp.zeros_array(2, np.int64)
    gen = pool.submit(tw.progress_counter, flag, -1, num_returns="streaming", max_buffered=4)
    assert gen.next(timeout=T).get(timeout=T) == 0  # an endless generator: it never ends
    gen.cancel()
    assert gen.join(timeout=T)


def test_streaming_back_pressure(pool):
    progress = mp.zeros_array(2, np.int64)
    gen = pool.submit(tw.progress_counter, progress, 100, num_returns="streaming",
                      max_buffered=3)
    wait_until(lambda: progress[0] >= 3)
    time.sleep(0.3)
    assert progress[0] == 3  # paused: the consumer is 3 values behind
    assert gen.next(timeout=T).get(timeout=T) == 0
    wait_until(lambda: progress[0] >= 4)
    time.sleep(0.2)
    assert progress[0] == 4
    assert [r.get(timeout=T) for r in gen] == list(range(1, 100))
    assert progress[1] == 1


def test_streaming_cancel_stops_the_generator_in_the_worker(pool):
    progress = mp.zeros_array(2, np.int64)
    gen = pool.submit(tw.progress_counter, progress, -1, num_returns="streaming")
    first = gen.next(timeout=T)
    wait_until(lambda: progress[0] > 100)  # running freely, far ahead of us
    gen.cancel()
    assert gen.join(timeout=T)
    assert progress[1] == 1  # GeneratorExit at its yield: its finally block ran
    stopped_at = progress[0]
    time.sleep(0.2)
    assert progress[0] == stopped_at
    assert first.get(timeout=T) == 0  # refs already returned stay valid
    with pytest.raises(TaskCancelledError):
        gen.next(timeout=T)
    assert pool.submit(tw.add, 1, 1).get(timeout=T) == 2  # the worker took the next task


def test_streaming_cancel_while_held_by_back_pressure(pool):
    progress = mp.zeros_array(2, np.int64)
    gen = pool.submit(tw.progress_counter, progress, -1, num_returns="streaming",
                      max_buffered=1)
    wait_until(lambda: progress[0] >= 1)
    gen.cancel()
    assert gen.join(timeout=T)
    assert progress[1] == 1


def test_streaming_generator_cannot_be_passed_to_a_task(pool):
    gen = pool.submit(tw.count, 3, num_returns="streaming")
    with pytest.raises(TypeError, match="streaming RefGenerator cannot be pickled"):
        pool.submit(tw.identity, gen)
    assert [r.get(timeout=T) for r in gen] == [0, 1, 2]


# ---- refs as arguments, get, wait ----------------------------------------------------------


def test_ref_argument_is_read_in_the_worker_zero_copy(pool):
    ref = pool.submit(tw.fill_tensor, 1000, 1.0)
    # The dependent task waits for the value, and changes the very memory the ref holds.
    assert pool.submit(tw.add_one_in_place, ref).get(timeout=T) == 2000.0
    assert float(ref.get(timeout=T).sum()) == 2000.0
    nested = pool.submit(tw.identity, [ref]).get(timeout=T)  # nested: still a Ref there
    assert isinstance(nested[0], mp.Ref) and float(nested[0].get().sum()) == 2000.0


def test_dependent_task_waits_for_its_argument(pool):
    slow = pool.submit(tw.sleep_then, 0.3, 5)
    dependent = pool.submit(tw.add, slow, 1)
    assert not dependent.ready()
    assert dependent.get(timeout=T) == 6


def test_error_in_an_argument_fails_the_dependent(pool):
    bad = pool.submit(tw.raise_value_error, "bad input")
    with pytest.raises(ValueError, match="bad input"):
        pool.submit(tw.add, bad, 1).get(timeout=T)


def test_get_and_wait_with_timeouts(pool):
    slow = pool.submit(tw.sleep_then, 1.5, "slow")
    fast = pool.submit(tw.sleep_then, 0.0, "fast")
    ready, not_ready = mp.wait([slow, fast], num_returns=1, timeout=T)
    assert ready == [fast] and not_ready == [slow]
    with pytest.raises(GetTimeoutError):
        slow.get(timeout=0.05)
    assert isinstance(GetTimeoutError("x"), TimeoutError)
    ready, not_ready = mp.wait([slow, fast], num_returns=2, timeout=0.01)
    assert ready == [fast]
    assert mp.get([slow, fast], timeout=T) == ["slow", "fast"]
    with pytest.raises(ValueError, match="num_returns"):
        mp.wait([slow], num_returns=2)


def test_unpicklable_value_and_exception_cause(pool):
    with pytest.raises(TypeError, match="pickle"):
        pool.submit(tw.unpicklable_value).get(timeout=T)
    with pytest.raises(ValueError, match="boom") as info:
        pool.submit(tw.raise_value_error, "boom").get(timeout=T)
    assert "raise_value_error" in str(info.value.__cause__)


def test_invalid_arguments(pool):
    for bad in (0, -1, True, "many", 1.5):
        with pytest.raises(ValueError, match="num_returns"):
            pool.submit(tw.count, 3, num_returns=bad)
    with pytest.raises(ValueError, match="max_buffered"):
        pool.submit(tw.count, 3, num_returns=3, max_buffered=2)
    with pytest.raises(ValueError, match="max_retries"):
        pool.submit(tw.add, 1, 2, max_retries=-1)
    with pytest.raises(ValueError, match="processes"):
        mp.TaskPool(0)
    with pytest.raises(TypeError, match="generator"):
        pool.submit(tw.count, 3).get(timeout=T)
    assert not hasattr(mp, "__all__") or "TaskPool" not in mp.__all__


# ---- lifetimes and memory ------------------------------------------------------------------


def test_values_are_freed_when_no_ref_remains():
    with mp.TaskPool(1) as pool:
        base = pool.submit(tw.worker_arena).get(timeout=T)
        owner_refs = mp.memory_stats()["live_refs"]
        refs = pool.submit(tw.large_values_generator, 4, 100_000, num_returns=4)
        dyn = pool.submit(tw.split, pool.put(np.ones(50_000)), 10_000, num_returns="dynamic")
        gen = pool.submit(tw.count, 10, num_returns="streaming")
        values = mp.get(refs, timeout=T) + [r.get(timeout=T) for r in dyn.get(timeout=T)]
        total = pool.submit(tw.get_size, dyn, 10_000).get(timeout=T)
        assert total == 50_000 and gen.next(timeout=T).get(timeout=T) == 0
        assert pool.submit(tw.worker_arena).get(timeout=T)[0] > base[0]
        del refs, dyn, gen, values
        wait_until(lambda: pool.submit(tw.worker_arena).get(timeout=T)[0] == base[0])
        assert mp.memory_stats()["live_refs"] == owner_refs


def test_generator_worker_holds_one_value_at_a_time_peak_rss():
    size = 32 << 20  # 32 MB int8 arrays, 6 of them
    with mp.TaskPool(1) as pool:
        pool.submit(tw.start_sampler).get(timeout=T)
        refs = pool.submit(tw.large_values_generator, 6, size, num_returns=6)
        assert all(v.shape == (size, 1) for v in mp.get(refs, timeout=T))
        base, peak = pool.submit(tw.stop_sampler).get(timeout=T)
        assert peak - base < 2.5 * size, (base, peak)
        # The same values from a function returning a list: all six at once.
        pool.submit(tw.start_sampler).get(timeout=T)
        list_refs = pool.submit(tw.large_values, 6, size, num_returns=6)
        mp.get(list_refs, timeout=T)
        base, peak_list = pool.submit(tw.stop_sampler).get(timeout=T)
        assert peak_list - base > 5 * size, (base, peak_list)
        del refs, list_refs


# ---- workers that die, retries, initializer, shutdown --------------------------------------


def test_killed_worker_fails_its_refs_and_is_replaced():
    with mp.TaskPool(1) as pool:
        pids = pool.pids
        flag = mp.zeros_array(1, np.int64)
        ref = pool.submit(tw.signal_then_sleep, flag, 60)
        wait_until(lambda: flag[0] != 0)
        os.kill(int(flag[0]), signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match="SIGKILL") as info:
            ref.get(timeout=T)
        assert info.value.signal_name == "SIGKILL" and info.value.pid == pids[0]
        assert pool.submit(tw.add, 2, 3).get(timeout=T) == 5
        assert pool.pids != pids
        # Values yielded before the death stay readable; the error comes at its position.
        gen = pool.submit(tw.yield_then_die, 3, num_returns="streaming")
        assert [gen.next(timeout=T).get(timeout=T) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(WorkerDiedError, match="signal SIGKILL"):
            gen.next(timeout=T)
        refs = pool.submit(tw.yield_then_die, 2, num_returns=3)
        assert mp.get(refs[:2], timeout=T) == [0, 1]
        with pytest.raises(WorkerDiedError):
            refs[2].get(timeout=T)


def test_max_retries_reruns_after_a_death():
    with mp.TaskPool(1) as pool:
        flag = mp.zeros_array(1, np.int64)
        gen = pool.submit(tw.die_on_first_attempt, flag, 6, num_returns="streaming",
                          max_retries=1)
        assert [r.get(timeout=T) for r in gen] == list(range(6))  # nothing twice
        assert flag[0] == 1


def test_initializer():
    with mp.TaskPool(1, initializer=tw.set_initialized, initargs=("yes",)) as pool:
        assert pool.submit(tw.get_initialized).get(timeout=T) == "yes"
    with mp.TaskPool(1, initializer=tw.failing_initializer) as pool:
        # submit() itself raises once the pool has read the worker's failure: a race
        with pytest.raises(PoolClosedError, match="initializer failed on purpose"):
            pool.submit(tw.add, 1, 2).get(timeout=T)


def test_shutdown_cancel_pending_and_submit_after_shutdown():
    pool = mp.TaskPool(1, start_method="spawn")
    running = pool.submit(tw.sleep_then, 0.5, "ran")
    pending = pool.submit(tw.sleep_then, 0.0, "never")
    pool.shutdown(wait=True, cancel_pending=True)
    assert running.get(timeout=T) == "ran"
    with pytest.raises(TaskCancelledError, match="cancel_pending"):
        pending.get(timeout=T)
    with pytest.raises(PoolClosedError):
        pool.submit(tw.add, 1, 2)
    assert mp.get(running) == "ran"  # values outlive their pool


def test_tensor_values_are_zero_copy(pool):
    ref = pool.submit(tw.fill_tensor, 1 << 16, 3.0)
    a, b = ref.get(timeout=T), ref.get(timeout=T)
    assert a.data_ptr() == b.data_ptr() and mp.is_shared(a)
    assert pool.submit(tw.sum_tensor, ref).get(timeout=T) == 3.0 * (1 << 16)
    assert isinstance(RemoteTaskError("x"), RuntimeError)


def test_dropping_a_streaming_generator_cancels_its_task(pool):
    progress = mp.zeros_array(2, np.int64)
    gen = pool.submit(tw.progress_counter, progress, -1, num_returns="streaming",
                      max_buffered=2)
    gen.next(timeout=T)
    del gen
    wait_until(lambda: progress[1] == 1)  # its finally ran: the worker closed it


def test_large_plain_values_travel_in_a_box():
    with mp.TaskPool(1, start_method="fork") as pool:
        base = pool.submit(tw.worker_arena).get(timeout=T)[0]
        ref = pool.submit(tw.big_list, 100_000)  # a pickle of ~500 kB: an arena block
        assert pool.submit(tw.length, ref).get(timeout=T) == 100_000
        assert ref.get(timeout=T)[-1] == 99_999
        assert pool.submit(tw.worker_arena).get(timeout=T)[0] == base + 1
        del ref
        wait_until(lambda: pool.submit(tw.worker_arena).get(timeout=T)[0] == base)


def test_shutdown_without_waiting_finishes_the_tasks():
    pool = mp.TaskPool(1)
    ref = pool.submit(tw.sleep_then, 0.2, "late")
    gen = pool.submit(tw.count, 3, num_returns="streaming")
    pool.shutdown(wait=False)
    assert ref.get(timeout=T) == "late"
    assert [r.get(timeout=T) for r in gen] == [0, 1, 2]
    pool._thread.join(T)  # the collector stops the workers once the tasks ended
    assert not pool._thread.is_alive() and pool.pids == []


def test_refs_travel_through_a_queue(pool):
    ref = pool.submit(tw.fill_tensor, 1 << 15, 4.0)
    ref.get(timeout=T)
    q = mp.get_context("fork").Queue()
    q.put(ref)
    copy = q.get(timeout=T)  # a Ref copy holding its own references to the value
    del ref
    assert float(copy.get(timeout=T).sum()) == 4.0 * (1 << 15)
    q.close()


_EXIT_SCRIPT = """
import numpy as np, torch_mp_ext as mp, _task_workers as tw
pool = mp.TaskPool(2)
assert pool.submit(tw.add, 1, 2).get(timeout=30) == 3
gen = pool.submit(tw.progress_counter, mp.zeros_array(2, np.int64), -1,
                  num_returns="streaming", max_buffered=2)
gen.next(timeout=30)
slow = pool.submit(tw.sleep_then, 60, 1)
print(*pool.pids)
"""


def test_exit_without_shutdown_terminates_the_pool():
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], env=env, timeout=60,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 30  # not waiting for the 60 s task

    def gone(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1][0] == "Z"
        except FileNotFoundError:
            return True

    for pid in map(int, proc.stdout.split()):
        wait_until(lambda pid=pid: gone(pid))


def test_dependencies_deep_in_containers(pool):
    slow = pool.submit(tw.sleep_then, 0.2, 7)
    nested = pool.submit(tw.identity, {"a": [(slow,)]}).get(timeout=T)
    assert nested["a"][0][0].get(timeout=T) == 7


def test_worker_killed_right_after_yielding_a_tensor():
    # The caller may or may not have mapped the new segment before the worker died: the
    # value is then readable, or its ref says it was lost; the pool goes on either way.
    with mp.TaskPool(1) as pool:
        for _ in range(3):
            gen = pool.submit(tw.yield_tensor_then_die, num_returns="streaming")
            try:
                assert float(gen.next(timeout=T).get(timeout=T).sum()) == 1 << 20
            except WorkerDiedError as e:
                assert "is lost" in str(e)
            with pytest.raises(WorkerDiedError, match="SIGKILL"):
                gen.next(timeout=T)
        assert pool.submit(tw.add, 1, 2).get(timeout=T) == 3


# ---- lifecycle (issue 26) ------------------------------------------------------------------


def test_a_pool_made_by_a_short_lived_thread_keeps_its_workers():
    """PR_SET_PDEATHSIG fires when the *thread* that forked a worker ends: a pool made by a
    thread that then exits lost its workers. Workers must die with the pool's process only
    (Note [Children die with their parent], the mechanism of processes/)."""
    made = []

    def make():
        pool = mp.TaskPool(2, start_method="fork")
        made.append(pool)
        # Both workers have started (and asked for whatever parent-death signal they ask for).
        pids = {r.get(timeout=T) for r in [pool.submit(tw.pid_after, 0.3) for _ in range(4)]}
        made.append(pids)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join(T)
    pool, pids = made
    try:
        assert pids == set(pool.pids)
        time.sleep(0.5)  # a signal from the thread's exit has arrived by now
        assert [pool.submit(tw.add, i, 1).get(timeout=T) for i in range(4)] == [1, 2, 3, 4]
        assert set(pool.pids) == pids  # nobody died and was replaced
    finally:
        pool.shutdown(wait=True)


def test_a_slow_worker_join_does_not_stall_other_pools():
    """STATE, every pool's lock, was held while a stopping pool joined its workers (up to
    5 s): submit() on any other pool waited as long."""
    slow = mp.TaskPool(1, start_method="fork")
    other = mp.TaskPool(1, start_method="fork")
    try:
        slow_pid = slow.submit(tw.slow_exit, 3.0).get(timeout=T)
        start = time.monotonic()
        slow.shutdown(wait=False)  # its collector now joins a worker that takes 3 s to exit
        time.sleep(0.5)
        waits = _submit_waits(other)
        assert max(waits) < 1.0, waits
        assert os.path.exists(f"/proc/{slow_pid}")  # the join was still going on
    finally:
        slow.shutdown(wait=True)
        other.shutdown(wait=True)
    assert time.monotonic() - start >= 2.5  # the join really was slow


def _submit_waits(pool):
    """How long each of five submit() calls on `pool` took (each result checked)."""
    waits = []
    for i in range(5):
        t0 = time.monotonic()
        ref = pool.submit(tw.add, i, 1)
        waits.append(time.monotonic() - t0)
        assert ref.get(timeout=T) == i + 1
    return waits


class _SlowStarts:
    """A pool's start-method context whose worker starts take ``seconds`` (as a spawn or
    forkserver start can on a loaded machine); ``began`` is set when one begins."""

    def __init__(self, ctx, seconds):
        self._ctx, self._seconds = ctx, seconds
        self.began, self.ended = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def Process(self, *args, **kwargs):  # noqa: N802 (the context's own name)
        process = self._ctx.Process(*args, **kwargs)
        start = process.start

        def slow_start():
            self.began.set()
            time.sleep(self._seconds)
            start()
            self.ended.set()

        process.start = slow_start
        return process


def test_a_slow_replacement_start_does_not_stall_other_pools():
    """A dead worker's replacement was started with STATE, every pool's lock, held: while a
    slow start ran, submit() on any other pool waited as long."""
    slow = mp.TaskPool(1, start_method="fork")
    other = mp.TaskPool(1, start_method="fork")
    try:
        pid = slow.submit(tw.pid_after, 0).get(timeout=T)
        starts = slow._ctx = _SlowStarts(slow._ctx, 3.0)
        os.kill(pid, signal.SIGKILL)
        assert starts.began.wait(T)  # the replacement's start is under way
        waits = _submit_waits(other)
        # A submit takes milliseconds; 1 s leaves room for a loaded machine, not for the
        # 3 s start it waited for.
        assert max(waits) < 1.0, waits
        assert not starts.ended.is_set()  # the start was still going on
        assert starts.ended.wait(T)
        assert slow.submit(tw.add, 2, 3).get(timeout=T) == 5  # the replacement works
    finally:
        slow.shutdown(wait=True)
        other.shutdown(wait=True)
