"""torch_mp_ext.DataLoader: a worker's death or hang names its cause (issue 29), and with
``max_worker_restarts`` the epoch goes on with the same batches, in the same order.

Every death here is real (SIGKILL from the test, a ctypes segfault, a SIGBUS on a full tmpfs
in a private mount namespace, the OOM killer in a cgroup of the test's own). A death is
noticed when the result queue has been quiet for torch's status interval (5 s), so most of
these tests are in the slow tier.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import _loader_workers as lw
import conftest
import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset

import torch_mp_ext as mp
from torch_mp_ext.errors import DataLoaderWorkerError, WorkerDiedError, WorkerRestartWarning
from torch_mp_ext.processes.context import is_ours

# Three workers on a 2-CPU machine: torch's advice against it is not what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

METHODS = ["fork", "spawn", "forkserver"]
T = 60.0  # seconds: the most any single wait in these tests may take
# The loaders' `timeout` in the hang tests: it must cover a worker's start (a spawn worker
# imports torch afresh: 10 s and more on 2 loaded CPUs) and its first batch.
HANG_TIMEOUT = {"fork": 12, "forkserver": 12, "spawn": 30}
EXPECTED = [torch.tensor([[i, i * i] for i in range(b, b + 4)], dtype=torch.float64)
            for b in range(0, 48, 4)]  # Numbers() in batches of 4, undisturbed


def _loader(method, dataset, **kwargs):
    kwargs.setdefault("timeout", T)
    return mp.DataLoader(dataset, batch_size=4, num_workers=3, multiprocessing_context=method,
                         **kwargs)


def _assert_undisturbed(batches):
    assert len(batches) == len(EXPECTED)
    for got, want in zip(batches, EXPECTED):
        assert torch.equal(got, want), (got, want)


def _restart_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, WorkerRestartWarning)]


def _released():
    """After a test dropped its loaders, iterators and batches: collects them (their workers
    are joined as they go) and drops the mappings of segments whose owner was killed (Note
    [Idle mappings of a gone owner]: a SIGKILLed worker retires nothing)."""
    gc.collect()
    mp.empty_cache()


# ---- surviving a death or a hang -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_an_epoch_survives_a_worker_killed_from_outside(method, persistent):
    loader = _loader(method, lw.Numbers(), max_worker_restarts=3,
                     persistent_workers=persistent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = iter(loader)
        first = [next(it)]
        victim = it._workers[1].pid  # owes batches 4, 7 and 10 at least
        os.kill(victim, signal.SIGKILL)
        epochs = [first + list(it)]
        if persistent:
            epochs.append(list(loader))  # the replacement serves the next epoch too
    for batches in epochs:
        _assert_undisturbed(batches)
    (message,) = _restart_warnings(caught)
    assert f"DataLoader worker (pid {victim}) is killed by signal: Killed." in message
    assert "SIGKILL came from outside torch_mp_ext" in message or "OOM killer" in message
    assert "replaced DataLoader worker 1" in message and "epoch goes on" in message
    del it, loader, epochs, first, batches
    _released()  # the autouse leak check then finds no ring, name, fd or process left


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_an_epoch_survives_a_hung_worker(method, persistent, tmp_path):
    # Sample 22 is in batch 5, worker 2's; it hangs the first time only.
    dataset = lw.Numbers(at=22, how="hang", flag=str(tmp_path / "hung"))
    loader = _loader(method, dataset, max_worker_restarts=3, persistent_workers=persistent,
                     timeout=HANG_TIMEOUT[method])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epochs = [list(loader)]
        if persistent:
            epochs.append(list(loader))
    for batches in epochs:
        _assert_undisturbed(batches)
    (message,) = _restart_warnings(caught)
    assert message.startswith(f"DataLoader timed out after {HANG_TIMEOUT[method]} seconds\n")
    assert "DataLoader worker 2 (pid " in message and "made no progress" in message
    assert "in __getitem__" in message  # its stack, from faulthandler
    del loader, epochs, batches
    _released()


@pytest.mark.slow
def test_a_segfault_once_is_replaced_with_its_stack(tmp_path):
    dataset = lw.Numbers(at=9, how="segv", flag=str(tmp_path / "crashed"))
    with pytest.warns(WorkerRestartWarning) as caught:
        batches = list(_loader("fork", dataset, max_worker_restarts=1))
    _assert_undisturbed(batches)
    message = _restart_warnings(caught)[0]
    assert "is killed by signal: Segmentation fault." in message
    assert "Stack of the crashed process (faulthandler)" in message
    assert "in __getitem__" in message
    del batches, caught
    _released()


# ---- what a death that is not replaced says ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("how, reason, words", [
    ("kill", "signal", ["is killed by signal: Killed.", "SIGKILL came from outside"]),
    ("segv", "segfault", ["is killed by signal: Segmentation fault.", "segmentation fault",
                          "Stack of the crashed process (faulthandler)", "in __getitem__"]),
    ("exit", "exit_code", ["exited unexpectedly with exit code 3."]),
])
def test_a_death_names_its_cause(how, reason, words):
    loader = _loader("fork", lw.Numbers(at=9, how=how, every_time=True))
    with pytest.raises(DataLoaderWorkerError) as info:
        list(loader)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert str(err).startswith(f"DataLoader worker (pid {err.pid}) ")
    assert err.reason == reason and err.worker_id == 2  # sample 9 is in batch 2: worker 2's
    for word in words:
        assert word in str(err)
    del info, err, loader
    _released()


@pytest.mark.slow
def test_restarts_run_out():
    loader = _loader("fork", lw.Numbers(at=9, how="kill", every_time=True),
                     max_worker_restarts=1)
    with pytest.warns(WorkerRestartWarning), pytest.raises(DataLoaderWorkerError) as info:
        list(loader)
    assert "is killed by signal: Killed." in str(info.value)
    assert "(max_worker_restarts=1)" in str(info.value)
    del info, loader
    _released()


def test_a_hung_worker_is_reported_with_its_stack(tmp_path):
    loader = _loader("fork", lw.Numbers(at=9, how="hang", every_time=True), timeout=2)
    with pytest.raises(DataLoaderWorkerError) as info:
        list(loader)
    err = info.value
    assert str(err).startswith("DataLoader timed out after 2 seconds\n")  # torch's words
    assert err.reason == "hung" and err.worker_id == 2 and err.exit_code is None
    assert "made no progress for 2 seconds" in str(err) and "in __getitem__" in str(err)
    del info, err, loader
    _released()


needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare(1) to mount a small tmpfs on a private /dev/shm",
)


@pytest.mark.slow
@needs_unshare
def test_a_bus_error_on_a_full_dev_shm_names_it():
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        import torch_mp_ext as mp
        import _loader_workers as lw
        loader = mp.DataLoader(lw.Numbers(at=5, how="bus", every_time=True), batch_size=4,
                               num_workers=1, multiprocessing_context="fork", timeout=60)
        try:
            list(loader)
        except mp.errors.DataLoaderWorkerError as e:
            print(e.reason)
            print(e)
    """)
    shell = f"mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {sys.executable} -c \"$0\""
    run = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", shell,
                          script], capture_output=True, text=True, timeout=T,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    out = run.stdout
    assert out.startswith("bus_error\n"), (out, run.stderr)
    assert "is killed by signal: Bus error." in out
    assert "/dev/shm has 0 B free of 4.0 MiB" in out and "--shm-size" in out
    assert "in _bus_error_on_full_dev_shm" in out



@pytest.mark.slow
def test_an_oom_kill_is_named(tmp_path):
    with conftest.memory_limited_cgroup("tmx-loader-oom") as cgroup:
        loader = _loader("fork", lw.Numbers(at=9, how="oom", every_time=True, flag=cgroup))
        with pytest.raises(DataLoaderWorkerError) as info:
            list(loader)
        message, reason = str(info.value), info.value.reason
        del info, loader
        _released()
    assert "is killed by signal: Killed." in message
    assert reason == "oom_kill" and "OOM killer" in message and "oom_kill" in message


# ---- construction ---------------------------------------------------------------------------


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_arguments_are_checked_early():
    with pytest.raises(ValueError, match="non-negative integer"):
        mp.DataLoader(lw.Numbers(), num_workers=2, max_worker_restarts=-1)
    with pytest.raises(ValueError, match="map-style dataset"):
        mp.DataLoader(_Stream(), num_workers=2, max_worker_restarts=1)
    with pytest.raises(ValueError, match="torch_mp_ext's contexts"):
        mp.DataLoader(lw.Numbers(), num_workers=2, max_worker_restarts=1,
                      multiprocessing_context=multiprocessing.get_context("fork"))


def test_workers_start_from_our_contexts():
    assert is_ours(mp.DataLoader(lw.Numbers(), num_workers=2).multiprocessing_context)
    assert mp.DataLoader(lw.Numbers(), num_workers=2, multiprocessing_context="spawn"
                         ).multiprocessing_context is mp.get_context("spawn")
    assert mp.DataLoader(lw.Numbers()).multiprocessing_context is None  # no workers
    assert isinstance(mp.DataLoader(lw.Numbers()), torch.utils.data.DataLoader)


def test_a_replacement_gets_every_argument_of_torchs_worker_loop():
    """A torch that adds a parameter to its worker loop fails here, in the fast tier."""
    import inspect

    from torch.utils.data._utils.worker import _worker_loop

    from torch_mp_ext.processes import loader as loader_module

    it = iter(_loader("fork", lw.Numbers()))
    kwargs = loader_module._worker_loop_kwargs(it, 1, it._index_queues[1])
    assert list(kwargs) == list(inspect.signature(_worker_loop).parameters)
    assert kwargs["worker_id"] == 1 and kwargs["base_seed"] == it._base_seed
    assert kwargs["init_fn"] is it._worker_init_fn
    del it, kwargs
    _released()


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_undisturbed_epochs_are_torchs(method):
    loader = _loader(method, lw.Numbers(), max_worker_restarts=2, persistent_workers=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", WorkerRestartWarning)
        _assert_undisturbed(list(loader))
        _assert_undisturbed(list(loader))
    del loader
    _released()


# ---- TaskPool: max_retries after an outside kill --------------------------------------------


def _wait_for_pid(flag):
    deadline = time.monotonic() + T
    while flag[0] == 0:
        assert time.monotonic() < deadline, "the task did not start in time"
        time.sleep(0.01)
    return int(flag[0])


@pytest.mark.parametrize("retries", [1, 0])
def test_a_task_killed_from_outside_runs_again_or_names_the_cause(retries):
    with mp.TaskPool(1, start_method="fork") as pool:
        flag = mp.zeros_array(2, np.int64)
        ref = pool.submit(lw.sleep_the_first_time, flag, 60, max_retries=retries)
        os.kill(_wait_for_pid(flag), signal.SIGKILL)
        if retries:
            assert ref.get(timeout=T) == "done"
        else:
            with pytest.raises(WorkerDiedError, match="terminated with signal SIGKILL") as info:
                ref.get(timeout=T)
            assert "SIGKILL came from outside torch_mp_ext" in str(info.value)


def test_a_task_whose_worker_segfaults_names_it_with_the_stack():
    with mp.TaskPool(1, start_method="fork") as pool:
        with pytest.raises(WorkerDiedError, match="terminated with signal SIGSEGV") as info:
            pool.submit(lw.crash_in_native_code).get(timeout=T)
        message = str(info.value)
        assert "A segmentation fault" in message
        assert "Stack of the crashed process (faulthandler)" in message
        assert "in crash_in_native_code" in message
        del info


def test_a_pipeline_stage_that_segfaults_is_named_with_its_stack():
    from torch_mp_ext.errors import PipelineError

    p = mp.pipeline(range(8), lw.crash_on, start_method="fork")
    with pytest.raises(PipelineError, match="SIGSEGV") as info:
        for _ in p:
            pass
    message = str(info.value)
    assert "A segmentation fault" in message
    assert "Stack of the crashed process (faulthandler)" in message
    assert "in crash_on" in message
    del info, p
