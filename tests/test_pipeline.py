"""torch_mp_ext.pipeline and @stage: order, end of stream, failures, deaths, early exits, memory.

Every test runs real processes under the leak check of conftest.py (no process, fd or segment
left). Iterating a pipeline has no timeout of its own, so each iteration here runs under
``deadline``, which interrupts the main thread (as Ctrl-C would) when it passes, and every
loop over the endless ``forever`` source has a bound of its own (``BOUND`` items).
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import gc
import importlib
import os
import pickle
import signal
import threading
import time

import _pipeline_workers as w
import pytest
import torch

import torch_mp_ext as mp
from torch_mp_ext.errors import PipelineError, RemoteTraceback

pipeline_module = importlib.import_module("torch_mp_ext.pipeline")  # mp.pipeline: the function
T = 60  # seconds any one test may iterate before it is interrupted
BOUND = 100_000  # items any loop over an endless source may take before the test fails


@contextlib.contextmanager
def deadline(seconds: float = T):
    """Interrupts the main thread (KeyboardInterrupt) if the block outlives ``seconds``.

    SIGINT gets Python's handler for the block: a run started as a script's background job
    inherits SIGINT ignored, and ``_thread.interrupt_main()`` then does nothing.
    """
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    done = threading.Event()

    def watch():
        if not done.wait(seconds):
            _thread.interrupt_main()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGINT, handler)


def bounded(iterable):
    """``iterable``, ended with a failure after ``BOUND`` items (an endless source must be
    stopped by what the test does, never by the test's timeout)."""
    for i, item in enumerate(iterable):
        assert i < BOUND, f"no end after {BOUND} items"
        yield item


def gone(pids, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(os.path.exists(f"/proc/{pid}") for pid in pids):
            return True
        time.sleep(0.02)
    return False


# ---- order and end of stream --------------------------------------------------------------


def test_generator_and_per_item_stages_in_order(start_method):
    p = mp.pipeline(w.count, w.square, w.plus_one, w.pairs, start_method=start_method)
    with deadline():
        out = list(p)
    assert out == [v for i in range(20) for v in (i * i + 1, -(i * i + 1))]
    assert len(p.pids) == 4 and gone(p.pids)
    assert list(p) == []  # ended: iterating again yields nothing


@pytest.mark.parametrize("ordered", [True, False])
def test_per_item_workers(ordered):
    p = mp.pipeline(range(60), w.jitter, w.plus_one, w.batches, workers=3, ordered=ordered)
    with deadline():
        batches = list(p)
    flat = [x for b in batches for x in b]
    assert len(p.pids) == 7  # 3 + 3 workers, 1 batches
    if ordered:
        assert flat == list(range(1, 61))
    else:
        assert sorted(flat) == list(range(1, 61))


def test_workers_run_in_separate_processes():
    with deadline():
        pids = set(mp.pipeline(range(40), w.jitter, w.pid_of, workers=2))
    assert len(pids) == 2 and os.getpid() not in pids


@pytest.mark.parametrize("source", [[], range(0), w.count], ids=["list", "range", "fn"])
def test_empty_and_stage_free_pipelines(source):
    with deadline():
        if source is w.count:
            assert list(mp.pipeline(functools.partial(w.count, 0), w.square)) == []
            assert list(mp.pipeline(w.count)) == list(range(20))  # a prefetching process
        else:
            assert list(mp.pipeline(source, w.square, workers=2)) == []


def test_arrays_and_tensors_cross_without_copies():
    with deadline():
        seen = list(mp.pipeline(w.arrays, w.square, w.describe_arrays))
        assert seen == [(float(i * i), True) for i in range(20)]
        results = list(mp.pipeline(w.arrays, w.square))
        assert all(mp.is_shared(r) for r in results)  # received as views of blocks
        assert [r[0, 0] for r in results] == [float(i * i) for i in range(20)]
        del results
        tensors = list(mp.pipeline(w.tensors, w.plus_one))
    assert [t[0, 0].item() for t in tensors] == [float(i + 1) for i in range(10)]
    assert all(mp.is_shared(t) for t in tensors)


# ---- failures -----------------------------------------------------------------------------


FAILURES = {
    # name: (source, stages, kwargs, failing position, stage name, exception type, items before)
    "source fn": (functools.partial(w.raising_source, 5), [w.plus_one], {}, 0,
                  "raising_source", ValueError, 5),
    "source iterable": (w.raising_source(5), [w.plus_one], {}, 0, "generator", ValueError, 5),
    "generator stage": (w.count, [w.raise_on_gen, w.plus_one], {}, 1, "raise_on_gen",
                        ValueError, 5),
    "per-item stage, 2 workers": (w.count, [w.plus_one, w.raise_on, w.plus_one],
                                  {"workers": 2}, 2, "raise_on", ValueError, 4),
    "last stage": (w.count, [w.square, w.decorated_raise], {}, 2, "decorated_raise",
                   KeyError, 2),
    "unpicklable exception": (w.count, [w.unpicklable_error], {}, 1, "unpicklable_error",
                              RemoteTraceback, 0),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_an_exception_anywhere_stops_everything(case):
    source, stages, kwargs, position, name, exc_type, before = FAILURES[case]
    p = mp.pipeline(source, *stages, **kwargs)
    got = []
    with deadline(), pytest.raises(PipelineError) as info:
        for item in p:
            got.append(item)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.stage == name and err.position == position and name in str(err)
    assert len(got) == before  # everything before the failure arrived, in order
    assert isinstance(err.__cause__, exc_type)
    if exc_type is not RemoteTraceback:
        remote = err.__cause__.__cause__
        assert isinstance(remote, RemoteTraceback) and "Traceback" in remote.tb
    assert gone(p.pids)
    assert pickle.loads(pickle.dumps(err)).stage == name  # nested pipelines pickle it


def test_an_exception_reports_the_item():
    with deadline(), pytest.raises(PipelineError, match=r"on item 5 of the stream") as info:
        list(mp.pipeline(w.count, w.raise_on, workers=3))
    assert "worker 2 of 3" in str(info.value) and info.value.worker == 2
    assert "per-item stage refused 5" in str(info.value)


def test_a_killed_stage_is_reported_with_its_signal():
    p = mp.pipeline(w.count, w.kill_self_on, w.plus_one)
    with deadline(), pytest.raises(PipelineError, match="SIGKILL") as info:
        list(p)
    err = info.value
    assert (err.stage, err.position, err.exit_code, err.signal_name) == (
        "kill_self_on", 1, -signal.SIGKILL, "SIGKILL")
    assert err.__cause__ is None and gone(p.pids)


def test_a_stage_killed_from_outside_while_blocked():
    p = mp.pipeline(w.forever, w.plus_one, buffer_size=2)
    with deadline():
        assert next(p) == 1
        victim = p.pids[1]
        os.kill(victim, signal.SIGTERM)
        with pytest.raises(PipelineError, match=f"pid {victim}.*SIGTERM"):
            for _ in bounded(p):
                pass
    assert gone(p.pids)


def test_a_stage_that_exits_without_finishing():
    with deadline(), pytest.raises(PipelineError, match="exited with code 0.*os._exit"):
        list(mp.pipeline(w.count, w.exit_quietly))


# ---- stopping early -----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["break", "close", "with", "gc", "ctrl-c"])
def test_stopping_early_leaves_nothing_behind(how):
    p = mp.pipeline(w.forever, w.square, w.plus_one, workers=2, buffer_size=2)
    pids: tuple = ()
    with deadline():
        if how == "break":
            for x in bounded(p):
                if x > 10:
                    break
            pids = p.pids
            del p  # a for loop's break drops the iterator: so does this
        elif how == "close":
            assert next(p) == 1
            pids = p.pids
            p.close()
            assert list(p) == []
        elif how == "with":
            with p:
                assert next(p) == 1
                pids = p.pids
        elif how == "gc":
            assert next(p) == 1
            pids = p.pids
            del p
            gc.collect()
        else:
            threading.Timer(0.5, _thread.interrupt_main).start()
            with pytest.raises(KeyboardInterrupt):
                for _ in bounded(p):
                    pids = p.pids
            assert list(p) == []
    assert len(pids) == 4 and gone(pids, timeout=1.0)


def test_stopping_with_arrays_in_flight_frees_them():
    p = mp.pipeline(w.arrays, w.square, buffer_size=3)
    with deadline():
        next(p)
        time.sleep(0.3)  # the queues fill up
        p.close()
    gc.collect()
    stats = mp.memory_stats()
    assert stats["live_blocks"] <= 1, stats  # at most this process's own, unrelated


def test_a_stuck_stage_is_terminated_after_the_grace_period(monkeypatch):
    # Where Pipeline reads it (patching the package's re-export changed nothing: 5 s waits).
    monkeypatch.setattr(importlib.import_module("torch_mp_ext.pipeline.api"),
                        "SHUTDOWN_GRACE_S", 0.5)
    p = mp.pipeline(w.count, w.sleep_forever)
    with deadline():
        with pytest.raises(StopIteration):
            threading.Timer(0.3, p.close).start()  # from another thread: next() returns
            next(p)
    assert gone(p.pids)


def test_a_second_ctrl_c_during_the_shutdown_kills_what_is_left():
    # The first Ctrl-C starts the shutdown, which waits for a stage stuck in its own code;
    # the second interrupts that wait: the stuck stage is killed, not left behind.
    p = mp.pipeline(w.count, w.sleep_forever)
    pids: tuple = ()
    with deadline():
        for delay in (0.5, 1.5):
            threading.Timer(delay, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            pids = p.pids
            next(p)
        pids = p.pids
        time.sleep(1.5)  # the second interrupt may land here if the first one's shutdown
    assert len(pids) == 2 and gone(pids, timeout=5.0)


def test_file_system_strategy_leaves_no_names():
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        with deadline():
            p = mp.pipeline(w.arrays, w.square, w.plus_one, start_method="fork")
            assert next(p)[0, 0] == 1.0
            p.close()
            assert sum(r[0, 0] for r in mp.pipeline(w.arrays, w.square)) == 2470.0
    finally:
        mp.set_sharing_strategy(before)


# ---- the decorator ------------------------------------------------------------------------


def test_decorated_stages_compose(start_method):
    composed = w.decorated_negate(w.decorated_square(w.count()))
    assert isinstance(composed, mp.Pipeline)
    with deadline():
        assert list(composed) == [-(i * i) for i in range(20)]
        assert len(composed.pids) == 2  # the source generator was iterated here
        in_process = w.decorated_negate(w.decorated_square(w.count))
        in_process._start_method = start_method
        assert list(in_process) == [-(i * i) for i in range(20)]
        assert len(in_process.pids) == 3
        mixed = mp.pipeline(w.count, w.decorated_square, w.plus_one, start_method=start_method)
        assert list(mixed) == [i * i + 1 for i in range(20)]


def test_a_composed_inner_call_cannot_be_iterated_too():
    inner = w.decorated_square(range(3))
    outer = w.decorated_negate(inner)
    with pytest.raises(RuntimeError, match="passed to another stage"):
        next(inner)
    with deadline():
        assert list(outer) == [0, -1, -4]


def test_local_stages_are_pickled_by_value():
    @mp.stage
    def local(items):
        yield from items

    with deadline():  # Note [By-value fallback] (sharing/byvalue.py)
        assert list(mp.pipeline(range(3), local, start_method="forkserver")) == [0, 1, 2]
        assert list(mp.pipeline(range(3), lambda x: -x, start_method="forkserver")) == [
            0, -1, -2]
    mp.set_pickle_by_value(False)
    try:  # as the standard library pickles: refused before any process starts
        with pytest.raises((pickle.PicklingError, AttributeError), match="local"):
            list(mp.pipeline(range(3), local, start_method="spawn"))
    finally:
        mp.set_pickle_by_value(True)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="buffer_size"):
        mp.pipeline(range(3), w.square, buffer_size=0)
    with pytest.raises(ValueError, match="workers"):
        mp.pipeline(range(3), w.square, workers=True)
    with pytest.raises(ValueError, match="start_method"):
        mp.pipeline(range(3), start_method="thread")
    with pytest.raises(TypeError, match="stage 2"):
        mp.pipeline(range(3), w.square, 42)
    with pytest.raises(TypeError, match="source"):
        mp.pipeline(42)
    with pytest.raises(ValueError, match="buffer_size"):
        mp.stage(-1)


def test_public_names():
    assert mp.pipeline is pipeline_module.pipeline and mp.stage is pipeline_module.stage
    assert "pipeline" not in mp.__all__ and mp.errors.PipelineError is PipelineError
    assert isinstance(torch.multiprocessing, type(mp))  # untouched


# ---- memory -------------------------------------------------------------------------------


def shared_segments(pids) -> dict:
    """inode -> bytes of every torch_mp_ext memfd segment any of ``pids`` maps (/proc)."""
    segments = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            if "/memfd:tmx_" not in line:
                continue
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            segments[fields[4]] = max(segments.get(fields[4], 0), end - start)
    return segments


def test_shared_memory_stays_bounded_on_a_long_stream():
    # Note [Pipeline memory]: 2 stages, buffer_size 2 -> about 3 * (2 + 1) items of 1 MiB,
    # at most 3 * (2 + 2), whatever the stream's length (300 items here). Counted for real:
    # every memfd segment mapped by any process of the pipeline, deduplicated by inode (a
    # block's owner keeps a freed block's segment for its next item: counted too).
    stages, buffer_size, n, item = 2, 2, 300, 1 << 20
    p = mp.pipeline(w.megabyte_arrays, w.square, w.plus_one, buffer_size=buffer_size)
    peak, total = 0, 0.0
    with deadline():
        for x in p:
            total += x[0, 0]
            del x
            segments = shared_segments((os.getpid(),) + p.pids)
            # Items are the segments of one 1 MiB block (the queues' rings are 4 MiB).
            items = sum(1 for size in segments.values() if item <= size < item + (1 << 20))
            peak = max(peak, items)
    assert total == sum(float(i * i + 1) for i in range(n))
    bound = (stages + 1) * (buffer_size + 2)
    print(f"peak shared memory: {peak} items of 1 MiB (bound {bound}; "
          f"{(stages + 1) * (buffer_size + 1)} = (stages + 1) * (buffer_size + 1))")
    assert 0 < peak <= bound  # 300 items went through


CTRL_C_SCRIPT = """
import signal, sys, time
sys.path[:0] = {paths!r}
import _pipeline_workers as w
import torch_mp_ext as mp

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, if inherited ignored
p = mp.pipeline(w.forever, w.square, w.plus_one, workers=2)
next(p)
print(" ".join(map(str, p.pids)), flush=True)
try:
    for _, _ in zip(range(6000), p):  # a bound: 60 s
        time.sleep(0.01)
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_in_a_terminal_stops_every_process():
    # A terminal sends SIGINT to the whole foreground process group: the stages ignore it and
    # the consumer, interrupted, stops them all. In a fresh interpreter, its own session.
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(tests)
    script = CTRL_C_SCRIPT.format(paths=[tests, root])
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 4
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=T)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(T)
    assert out.strip() == "interrupted" and proc.returncode == 0
    assert gone(pids)


# ---- a blocked stage costs no CPU (issue 26) ------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _wakeups(pid: int) -> int:
    """Context switches of every thread of ``pid`` so far: one per sleep that ended."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as f:
            total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
    return total


@pytest.mark.slow  # measures 5 s of blocking on purpose
def test_stages_blocked_on_a_consumer_that_stopped_reading_cost_no_cpu():
    """Issue 26: producers polled ``full()`` with millisecond sleeps; four stage processes
    blocked on a consumer that stopped reading burned 12-23 % CPU each (about 1 % on the
    development machine). They must sleep on the ring's condition."""
    p = mp.pipeline(w.forever, w.square, w.plus_one, w.pairs, buffer_size=2)
    try:
        with deadline():
            assert next(p) == 1  # 0 squared, plus one
            time.sleep(1.0)  # every queue fills up; every stage blocks
            assert len(p.pids) == 4
            before = {pid: (_wakeups(pid), _cpu_seconds(pid)) for pid in p.pids}
            time.sleep(5.0)
            used = {pid: (_wakeups(pid) - before[pid][0], _cpu_seconds(pid) - before[pid][1])
                    for pid in p.pids}
        # A stage sleeping on the ring wakes 10 times a second for its stop check: 50 wake-ups
        # in 5 s (exactly 50 on the development machine). Polling with millisecond sleeps
        # wakes hundreds to thousands of times. CPU time comes in 10 ms clock ticks, sampled:
        # a sleeping stage still gets charged a tick or two now and then, so its bound (2 % of
        # 5 s) is loose; the wake-up count is the exact measure.
        assert all(wakeups <= 150 for wakeups, _ in used.values()), used
        assert all(cpu <= 0.1 for _, cpu in used.values()), used
    finally:
        p.close()
    assert gone(p.pids)
