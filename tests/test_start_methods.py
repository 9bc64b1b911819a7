"""Code that runs under fork runs under spawn and forkserver too (issue 30).

- By-value fallback (Note [By-value fallback] in sharing/byvalue.py): lambdas, local functions
  and classes, and objects of a ``__main__`` children cannot import, reach spawn and
  forkserver children. The matrix runs tests/_by_value_script.py as a script, as
  ``python -c`` and from stdin, under spawn and forkserver, against the results under fork;
  and the same script with stock ``torch.multiprocessing``, recording that it fails.
- Fork after threads (Note [Fork after threads] in processes/forkcheck.py): one warning.
- ``spawn``/``start_processes`` with ``kwargs=`` and ``return_values=True``.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torch_mp_ext as mp
from torch_mp_ext.errors import ProcessRaisedException

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SCRIPT = TESTS / "_by_value_script.py"
T = 120

#: What every case of the script gives under fork (and must give under spawn/forkserver).
EXPECTED = {
    "lambda_target": 42,
    "local_function_to_spawn": [10, 11],
    "main_class_through_queue": ["Point", 3],
    "pool_map_lambda": [0, 1, 4, 9, 16],
    "executor_submit_lambda": 42,
    "dataloader_lambda_collate": [[0, 10], [40, 90], [160, 250]],
    "task_pool_local": 27,
    "pipeline_local_stage": [1, 2, 3, 4],
}
MODES = ["file", "c", "stdin"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run_script(mode: str, method: str, impl: str = "torch_mp_ext", timeout: float = 420):
    """Runs the script as ``mode`` says; returns (results, the completed process)."""
    env = _env(TMX_METHOD=method, TMX_IMPL=impl)
    source = SCRIPT.read_text()
    if mode == "file":
        args, stdin = [sys.executable, str(SCRIPT)], None
    elif mode == "c":
        args, stdin = [sys.executable, "-c", source], None
    else:
        args, stdin = [sys.executable, "-"], source
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=str(TESTS))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS: ")]
    assert done.returncode == 0 and lines, f"rc={done.returncode}\n{done.stdout}\n{done.stderr}"
    return json.loads(lines[-1][len("RESULTS: "):]), done


# ---- by-value fallback --------------------------------------------------------------------


@pytest.mark.slow  # reason: 8 cases, each starting processes (spawn: 20 s a run)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("mode", MODES)
def test_fork_code_runs_under_spawn_and_forkserver(mode, method):
    results, _ = run_script(mode, method)
    assert results == EXPECTED


@pytest.mark.slow  # reason: the reference run, starting processes for 8 cases
def test_fork_gives_the_expected_results():
    results, _ = run_script("file", "fork")
    assert results == EXPECTED


#: The cases stock torch.multiprocessing fails, per way of running the script: a class of
#: __main__ reaches a child only when the child can import __main__ (a script file).
STOCK_FAILS = {
    "file": {"lambda_target", "local_function_to_spawn", "pool_map_lambda",
             "executor_submit_lambda", "dataloader_lambda_collate"},
    "c": {"lambda_target", "local_function_to_spawn", "main_class_through_queue",
          "pool_map_lambda", "executor_submit_lambda", "dataloader_lambda_collate"},
}
STOCK_FAILS["stdin"] = STOCK_FAILS["c"]


@pytest.mark.slow  # reason: stock spawn and forkserver children, three ways of running
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("mode", MODES)
def test_stock_torch_multiprocessing_fails_the_same_code(mode, method):
    results, _ = run_script(mode, method, impl="torch")
    failed = {case for case, result in results.items()
              if isinstance(result, str) and result.startswith("error: ")}
    assert failed == STOCK_FAILS[mode], results
    for case in set(results) - failed:
        assert results[case] == EXPECTED[case]


def test_a_local_class_crosses_a_queue_and_keeps_its_identity():
    class Local:
        def __init__(self, value):
            self.value = value

    q = mp.Queue()
    try:
        q.put(Local(5))
        q.put(lambda x: x + 1)
        got, fn = q.get(timeout=T), q.get(timeout=T)
        assert type(got) is Local and got.value == 5  # one class per process (cloudpickle)
        assert fn(1) == 2
    finally:
        q.close()


def test_by_value_off_raises_the_plain_error_naming_the_object():
    mp.set_pickle_by_value(False)
    q = mp.Queue()
    try:
        with pytest.raises((pickle.PicklingError, AttributeError)) as info:
            q.put(lambda: 1)
        text = "".join(getattr(info.value, "__notes__", [])) + str(info.value)
        assert "<lambda>" in text and "pickling by value is off" in text
    finally:
        mp.set_pickle_by_value(True)
        q.close()


@pytest.mark.slow  # reason: a fresh interpreter without cloudpickle
def test_without_cloudpickle_the_error_names_the_package():
    code = textwrap.dedent("""
        import sys
        sys.modules["cloudpickle"] = None  # as if not installed
        import torch_mp_ext as mp
        q = mp.Queue()
        try:
            q.put(lambda: 1)
        finally:
            q.close()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(), timeout=T)
    assert done.returncode != 0
    assert "cloudpickle, which is not installed: pip install cloudpickle" in done.stderr


def test_an_unpicklable_object_names_both_reasons():
    import threading

    lock = threading.Lock()
    q = mp.Queue()
    try:
        with pytest.raises((pickle.PicklingError, AttributeError)) as info:
            q.put(lambda: lock)  # local: by value, where the lock it uses fails
        notes = "".join(getattr(info.value, "__notes__", []))
        assert "<lambda>" in str(info.value) + notes
        assert "by value (cloudpickle) failed too" in notes and "lock" in notes
    finally:
        q.close()


# ---- spawn: kwargs and return values --------------------------------------------------------


def test_kwargs_and_return_values_of_a_local_function():
    def work(i, scale, *, offset):
        return {"index": i, "value": i * scale + offset}

    got = mp.start_processes(work, args=(10,), nprocs=2, start_method="forkserver",
                             kwargs={"offset": 1}, return_values=True)
    assert got == [{"index": 0, "value": 1}, {"index": 1, "value": 11}]
    # Without return_values, what torch returns: None.
    assert mp.start_processes(work, args=(10,), nprocs=1, start_method="forkserver",
                              kwargs={"offset": 1}) is None


def _fails_at_one(i, *, value):
    if i == 1:
        raise ValueError(f"boom {value}")
    return value


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_results_after_join_and_exceptions_still_propagate(method):
    context = mp.start_processes(_fails_at_one, nprocs=1, join=False, start_method=method,
                                 kwargs={"value": 7}, return_values=True)
    assert context.results is None
    while not context.join(T):
        pass
    assert context.results == [7]
    with pytest.raises(ProcessRaisedException, match="boom 7") as info:
        mp.start_processes(_fails_at_one, nprocs=2, start_method=method, kwargs={"value": 7},
                           return_values=True)
    assert isinstance(info.value.__cause__, ValueError)


def test_kwargs_must_be_a_dict():
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        mp.spawn(_fails_at_one, nprocs=1, kwargs=[("value", 1)])


# ---- fork after threads -------------------------------------------------------------------

FORK_CHECK = textwrap.dedent("""
    import threading, warnings
    import torch
    import torch_mp_ext as mp
    from torch_mp_ext.errors import ForkAfterThreadsWarning

    def fork_twice():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                p = mp.get_context("fork").Process(target=int)
                p.start()
                p.join(60)
                assert p.exitcode == 0
        return [str(w.message) for w in seen if w.category is ForkAfterThreadsWarning]

    if __name__ == "__main__":
        torch.set_num_threads(1)
        print("ALONE", len(fork_twice()))
        stop = threading.Event()
        {start}
        got = fork_twice()
        print("THREADS", len(got))
        print("MESSAGE", got[0] if got else "")
        stop.set()
""")
PYTHON_THREAD = ("sleeper = threading.Thread(target=stop.wait, name='sleeper'); "
                 "sleeper.start()")
OPENMP_POOL = ("torch.set_num_threads(2); "
               "torch.ones(1 << 24).add_(1).sum()  # a parallel op: OpenMP's pool stays")


def _fork_check(start: str) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", FORK_CHECK.format(start=start)],
                          capture_output=True, text=True, env=_env(), timeout=T)
    assert done.returncode == 0, done.stderr
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)


def test_fork_after_a_python_thread_warns_once_naming_it():
    out = _fork_check(PYTHON_THREAD)
    assert out["ALONE"] == "0"  # no extra thread: no warning
    assert out["THREADS"] == "1"  # two forks: one warning
    assert "'sleeper'" in out["MESSAGE"] and "forkserver" in out["MESSAGE"]


@pytest.mark.slow  # reason: a second fresh interpreter (the first covers the mechanism)
def test_fork_after_an_openmp_pool_warns_once():
    out = _fork_check(OPENMP_POOL)
    assert out["ALONE"] == "0"
    assert out["THREADS"] == "1"
    assert "native thread" in out["MESSAGE"]
