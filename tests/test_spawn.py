"""start_processes / spawn / ProcessContext with real processes: parity, errors, shutdown."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import tempfile
import time

import _spawn_workers as w
import pytest
from conftest import memory_limited_cgroup

import torch_mp_ext as mp
from torch_mp_ext.errors import ProcessException, RemoteTraceback

torch_spawn = sys.modules["torch.multiprocessing.spawn"]

TIMEOUT = 60.0


def get(q, timeout=TIMEOUT):
    """SimpleQueue.get with a timeout."""
    if not q._reader.poll(timeout):
        raise TimeoutError(f"nothing on the queue within {timeout} s")
    return q.get()


def join_within(context, seconds=TIMEOUT, grace_period=None):
    """Joins until done; kills everything and fails after ``seconds``."""
    deadline = time.monotonic() + seconds
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic()),
                               grace_period=grace_period):
            if time.monotonic() > deadline:
                raise AssertionError(f"processes still running after {seconds} s")
    except AssertionError:
        for p in context.processes:
            p.kill()
            p.join(10)
        raise


def start(fn, args=(), nprocs=2, start_method="forkserver"):
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method=start_method)


def raised(fn, args=(), nprocs=2, start_method="forkserver", grace_period=None):
    context = start(fn, args, nprocs, start_method)
    with pytest.raises(ProcessException) as info:
        join_within(context, grace_period=grace_period)
    return info.value, context


# --- parity -------------------------------------------------------------------------------


def test_each_start_method_runs_every_index(start_method, ctx):
    q = ctx.SimpleQueue()
    context = start(w.put_index, (q,), nprocs=3, start_method=start_method)
    join_within(context)
    assert sorted(get(q) for _ in range(3)) == [0, 1, 2]
    assert context.join() is True  # again: still True
    assert all(p.exitcode == 0 for p in context.processes)


def test_spawn_joins_by_default_and_warns_on_other_methods():
    assert mp.spawn(w.succeed, nprocs=1) is None
    with pytest.warns(FutureWarning, match="only supports start_method=spawn"):
        mp.spawn(w.succeed, nprocs=1, start_method="fork")


def test_spawn_context_is_the_old_name():
    with pytest.warns(UserWarning, match="renamed to ProcessContext"):
        context = mp.SpawnContext([], [])
    assert isinstance(context, mp.ProcessContext) and context.join() is True


def test_exceptions_are_torchs_and_pickle():
    err = mp.ProcessExitedException("Oh no!", 1, 42, -9, "SIGKILL")
    assert isinstance(err, torch_spawn.ProcessExitedException)
    assert isinstance(mp.ProcessRaisedException("m", 0, 1), torch_spawn.ProcessRaisedException)
    back = pickle.loads(pickle.dumps(err))
    assert (back.msg, back.error_index, back.error_pid, back.pid, back.exit_code,
            back.signal_name) == ("Oh no!", 1, 42, 42, -9, "SIGKILL")


@pytest.fixture
def spawn_log(caplog):
    """caplog for torch's spawn logger, which import torch sets not to propagate to the
    root logger (torch._logging), so caplog's root handler alone would see nothing."""
    logger = logging.getLogger("torch.multiprocessing.spawn")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="torch.multiprocessing.spawn"):
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def test_shutdown_after_failure_logs_like_torch(spawn_log):
    caplog = spawn_log
    context = start(w.raise_at, ({0}, 0.0))
    pid1 = context.processes[1].pid
    # Rank 1 would sleep 0.5 s: without a grace period it gets SIGTERM at once.
    with pytest.raises(mp.ProcessRaisedException):
        join_within(context)
    assert f"Terminating process {pid1} via signal SIGTERM" in caplog.records[0].getMessage()
    assert caplog.records[0].name == "torch.multiprocessing.spawn"


# --- errors -------------------------------------------------------------------------------


def test_child_exception_object_is_the_cause(start_method):
    err, context = raised(w.raise_at, ({1}, 0.0), start_method=start_method)
    assert isinstance(err, mp.ProcessRaisedException) and (err.error_index, err.pid) == (
        1, context.pids()[1])
    assert err.msg.endswith("\nValueError: legitimate exception from process 1\n")
    cause = err.__cause__
    assert type(cause) is ValueError and str(cause) == "legitimate exception from process 1"
    assert isinstance(cause.__cause__, RemoteTraceback)
    assert "in raise_at" in str(cause.__cause__)


def test_unpicklable_exception_travels_as_text():
    err, _ = raised(w.raise_unpicklable, nprocs=1)
    assert err.__cause__ is None
    assert err.msg.endswith("NeedsTwoArgs: odd exception\n")


def test_every_failed_process_is_listed():
    err, context = raised(w.raise_at, ({0, 2}, 0.0), nprocs=3, grace_period=20)
    assert sorted(f.index for f in err.failures) == [0, 2]
    assert err.failures[0].index == err.error_index
    assert {f.reason for f in err.failures} == {"raised"}
    assert "2 processes failed" in err.msg
    for i in (0, 2):
        assert f"process {i} (pid {context.pids()[i]}): raised ValueError" in err.msg
    assert context.processes[1].exitcode == 0  # exited by itself within the grace period


@pytest.mark.parametrize(
    "how, name, reason, words",
    [
        ("segv", "SIGSEGV", "segfault", ["segmentation fault", "Stack of the crashed process",
                                         "in crash"]),
        ("bus", "SIGBUS", "bus_error", ["/dev/shm", "--shm-size", "in _bus_error"]),
        ("abort", "SIGABRT", "abort", ["abort()", "in crash"]),
        ("kill", "SIGKILL", "signal", ["SIGKILL came from outside"]),
    ],
)
def test_signal_deaths_are_named_and_explained(how, name, reason, words):
    err, context = raised(w.crash, (how,))
    assert isinstance(err, mp.ProcessExitedException)
    assert err.msg.startswith(f"process 0 terminated with signal {name}\n")
    assert (err.signal_name, err.exit_code) == (name, -getattr(signal, name))
    assert err.failures[0].reason == reason
    for word in words:
        assert word in err.msg
    assert len(err.failures) == 1  # rank 1 was stopped by us: not a failure


def test_exit_code_is_reported():
    err, _ = raised(w.crash, ("exit",))
    assert err.msg.startswith("process 0 terminated with exit code 7")
    assert (err.exit_code, err.signal_name) == (7, None)



def test_oom_kill_is_recognised():
    with memory_limited_cgroup("tmx-oom-test") as cgroup:
        err, _ = raised(w.exhaust_memory, (cgroup,), nprocs=1)
    assert err.signal_name == "SIGKILL"
    assert err.failures[0].reason == "oom_kill"
    assert "OOM killer" in err.msg and "oom_kill" in err.msg


def test_error_files_are_removed_once_read():
    context = start(w.raise_at, ({0, 1}, 0.0))
    directory = os.path.dirname(context.error_files[0])
    assert os.path.isdir(directory)
    with pytest.raises(mp.ProcessRaisedException):
        join_within(context, grace_period=10)
    assert not os.path.exists(directory)
    success = start(w.succeed)
    join_within(success)
    assert not os.path.exists(os.path.dirname(success.error_files[0]))


def _error_dirs():
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("torch_mp_ext-errors-")}


def test_failed_start_stops_the_started_ones():
    w.FailsOnSecondPickle.pickled = 0
    before = _error_dirs()
    with pytest.raises(TypeError, match="cannot pickle this twice"):
        mp.start_processes(w.succeed, args=(w.FailsOnSecondPickle(),), nprocs=2,
                           start_method="spawn")
    assert _error_dirs() == before  # and the leak check sees no process left


# --- shutdown -----------------------------------------------------------------------------


def test_child_ignoring_sigterm_is_killed_within_the_grace_bound(spawn_log):
    caplog = spawn_log
    context = start(w.ignore_sigterm, nprocs=2)
    t0 = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException):
        join_within(context, grace_period=0.5)
    assert time.monotonic() - t0 < 10  # 0.3 s to fail, 0.5 s grace, SIGTERM, 0.5 s, SIGKILL
    assert context.processes[1].exitcode == -signal.SIGKILL
    messages = [r.getMessage() for r in caplog.records]
    pid1 = context.pids()[1]
    assert f"Terminating process {pid1} via signal SIGTERM" in messages
    assert (f"Unable to shutdown process {pid1} via SIGTERM , forcefully exiting via SIGKILL"
            in messages)
