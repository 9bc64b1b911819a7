"""The fast forkserver path and dying with the parent, with real processes (and real SIGKILLs)."""

from __future__ import annotations

import json
import multiprocessing.forkserver
import os
import select
import signal
import subprocess
import sys
import time

import _spawn_workers as w
import pytest
from test_spawn import get, join_within, start

import torch_mp_ext as mp
from torch_mp_ext.processes import forkserver as _forkserver

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


def _env(**extra):
    path = os.pathsep.join([REPO, TESTS, os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, **extra)


def _reports(q, n):
    return sorted((get(q) for _ in range(n)), key=lambda r: r["index"])


def test_workers_fork_from_the_server_and_see_the_launchers_state(monkeypatch):
    mp.start_forkserver()
    server = _forkserver.server_pid()
    monkeypatch.setenv("TMX_TEST_VAR", "set after the server started")
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        q = mp.get_context("forkserver").SimpleQueue()
        join_within(start(w.report, (q,), nprocs=2))
        reports = _reports(q, 2)
    finally:
        mp.set_sharing_strategy(before)
    assert [r["ppid"] for r in reports] == [server, server]
    assert {r["env"] for r in reports} == {"set after the server started"}
    assert {r["strategy"] for r in reports} == {"file_system"}


def test_workers_take_ctrl_c_like_spawn_workers():
    q = mp.get_context("forkserver").SimpleQueue()
    context = start(w.ready_then_sleep, (q,), nprocs=1)
    os.kill(get(q), signal.SIGINT)  # KeyboardInterrupt: the worker exits 0, as torch's do
    join_within(context, seconds=20)
    assert context.processes[0].exitcode == 0


def test_parallel_start_off_starts_one_by_one_from_the_same_server(monkeypatch):
    # One forkserver: TORCH_MP_PARALLEL_START=0 changes the order of starts, not the server.
    monkeypatch.setenv(mp.ENV_VAR_PARALLEL_START, "0")
    mp.start_forkserver()
    q = mp.get_context("forkserver").SimpleQueue()
    join_within(start(w.report, (q,), nprocs=2))
    assert [r["ppid"] for r in _reports(q, 2)] == [_forkserver.server_pid()] * 2
    assert multiprocessing.forkserver._forkserver._forkserver_pid is None


def test_get_context_forkserver_is_the_fast_server():
    ctx = mp.get_context("forkserver")
    assert ctx.Process is _forkserver.ForkServerProcess
    assert mp.get_context("spawn").get_context("forkserver") is ctx
    mp.start_forkserver()
    q = ctx.SimpleQueue()
    p = ctx.Process(target=w.report_ppid, args=(q,))
    p.start()
    try:
        assert get(q) == _forkserver.server_pid()
    finally:
        p.join(30)
    assert p.exitcode == 0
    assert multiprocessing.forkserver._forkserver._forkserver_pid is None


def test_set_forkserver_preload_takes_our_server(monkeypatch):
    monkeypatch.setattr(_forkserver._server, "preload", list(_forkserver._DEFAULT_PRELOAD))
    mp.set_forkserver_preload(["json", "__main__"])
    assert _forkserver._server.preload == [*_forkserver._DEFAULT_PRELOAD, "json"]
    with pytest.raises(TypeError):
        mp.get_context("forkserver").set_forkserver_preload([1])


MAIN_SCRIPT = """
import json, os, sys, threading, time
MARK = os.getpid()
if {start_thread}:
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
import torch_mp_ext as mp
import _spawn_workers as w
if __name__ == "__main__":
    q = mp.get_context("forkserver").SimpleQueue()
    mp.start_processes(w.report, args=(q,), nprocs=2, start_method="forkserver")
    print(json.dumps([q.get() for _ in range(2)]))
"""


@pytest.mark.parametrize("start_thread", [False, True], ids=["safe", "starts-a-thread"])
def test_main_module_is_preloaded_where_safe(tmp_path, start_thread):
    script = tmp_path / "main_mark.py"
    script.write_text(MAIN_SCRIPT.format(start_thread=start_thread))
    out = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reports = json.loads(out.stdout)
    if start_thread:  # imported by each worker itself, as under the standard forkserver
        assert all(r["main_mark"] == r["pid"] for r in reports)
        assert "not preloading" in out.stderr and "started threads" in out.stderr
    else:  # imported once, by the server (the workers' parent)
        assert all(r["main_mark"] == r["ppid"] for r in reports)
        assert "not preloading" not in out.stderr
    # The launcher stopped and reaped its server at exit: not even a zombie is left.
    assert not os.path.exists(f"/proc/{reports[0]['ppid']}")


ARGV_SCRIPT = """
import json, os, sys
MARK = os.getpid()
LABEL = sys.argv[1]  # fails under the server's own argv (['-c'])
import torch_mp_ext as mp
import _spawn_workers as w
if __name__ == "__main__":
    q = mp.get_context("forkserver").SimpleQueue()
    mp.start_processes(w.report, args=(q,), nprocs=2, start_method="forkserver")
    print(json.dumps([q.get() for _ in range(2)]))
"""


@pytest.mark.slow  # a script that starts a forkserver: 4 s
def test_a_main_that_reads_its_arguments_at_import_is_preloaded_with_them(tmp_path):
    """Issue 36: the server imported main with its own argv (['-c']): ``sys.argv[1]`` at
    import failed there, every worker imported main again (seconds for a training script)
    and stderr said "not preloading ... IndexError", which the standard forkserver never
    prints. The server now imports main with the launcher's arguments."""
    script = tmp_path / "main_argv.py"
    script.write_text(ARGV_SCRIPT)
    out = subprocess.run([sys.executable, str(script), "label"], env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(r["main_mark"] == r["ppid"] for r in json.loads(out.stdout))  # preloaded
    assert out.stderr == ""


ORPHAN_SCRIPT = """
import json, sys, time
import multiprocessing.forkserver
import torch_mp_ext as mp
import _spawn_workers as w
method, grandchild_method = sys.argv[1:3]
q = mp.get_context(method).SimpleQueue()
mp.start_processes(w.start_grandchild_and_sleep, args=(q, grandchild_method), nprocs=2,
                   join=False, start_method=method)
items = [q.get() for _ in range(4)]
pids = [p for item in items for p in (item if isinstance(item, list) else [item]) if p]
servers = [mp.processes.forkserver.server_pid(),
           multiprocessing.forkserver._forkserver._forkserver_pid]
print(json.dumps(pids + [p for p in servers if p]), flush=True)
time.sleep(120)
"""


def _running(pid):
    """True if pid exists and is not a zombie (orphans may wait long for init to reap them)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize(
    "method, grandchild_method, parallel_start",
    [("spawn", "fork", None), ("fork", "fork", None), ("forkserver", "forkserver", None),
     ("forkserver", "fork", "0")],
    ids=["spawn", "fork", "fast-forkserver", "stdlib-forkserver"],
)
def test_no_descendant_survives_a_sigkilled_parent(method, grandchild_method, parallel_start):
    extra = {} if parallel_start is None else {mp.ENV_VAR_PARALLEL_START: parallel_start}
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, method, grandchild_method],
                              env=_env(**extra), stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 120)
        assert ready, "the parent did not report its descendants within 120 s"
        pids = json.loads(parent.stdout.readline())
        assert len(pids) >= 4 and all(_running(p) for p in pids)
    finally:
        parent.kill()
        parent.wait(30)
        parent.stdout.close()
    deadline = time.monotonic() + 15
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if _running(p)] == []


THREAD_SCRIPT = """
import json, sys, threading, time
import torch_mp_ext as mp
import _spawn_workers as w
method = sys.argv[1]
q = mp.get_context(method).SimpleQueue()
started = []
t = threading.Thread(target=lambda: started.append(mp.start_processes(
    w.ready_then_sleep, args=(q,), nprocs=2, join=False, start_method=method)))
t.start()
t.join()  # the thread that started the workers is gone
pids = [q.get() for _ in range(2)]
time.sleep(0.5)
print(json.dumps(pids), flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfd and PDEATHSIG are Linux's")
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_workers_outlive_the_thread_that_started_them_not_the_process(method):
    # Note [Children die with their parent]: PDEATHSIG would have killed them with the thread.
    parent = subprocess.Popen([sys.executable, "-c", THREAD_SCRIPT, method], env=_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 120)
        assert ready, "the parent did not report its workers within 120 s"
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 2 and all(_running(p) for p in pids)
    finally:
        parent.kill()
        parent.wait(30)
        parent.stdout.close()
    deadline = time.monotonic() + 15
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if _running(p)] == []
