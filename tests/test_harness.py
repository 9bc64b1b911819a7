"""The test harness itself (tests/conftest.py): its leak check catches each kind of leak, and
no test can hang the run, even with SIGINT ignored or the main thread out of SIGALRM's reach.

Each case runs a small test file under a copy of our conftest.py in a pytest of its own, in
a fresh session started the way a script starts a background job (``bash -c 'pytest & wait'``:
SIGINT ignored), with short timeouts (``TMX_TEST_*`` variables) so the run takes seconds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

TESTS = Path(__file__).resolve().parent

INNER = """
import gc, os, signal, subprocess, time
import pytest

SHM = "/dev/shm/tmx_harness_" + os.environ["HARNESS_TOKEN"]


def test_clean():
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # as a script's background job


def test_leaks_a_shm_entry():
    os.close(os.open(SHM, os.O_CREAT | os.O_RDWR, 0o600))


def test_leaks_an_fd():
    os.open(os.devnull, os.O_RDONLY)


def test_leaks_a_child():
    subprocess.Popen(["sleep", "600"])


class Cycle:
    def __init__(self):
        self.me = self
        self.fd = os.open(os.devnull, os.O_RDONLY)

    def __del__(self):
        os.close(self.fd)


def test_cyclic_garbage_holding_an_fd_is_not_a_leak():
    gc.disable()  # until the leak check collects it, the cycle keeps its fd open
    try:
        Cycle()
    finally:
        gc.enable()


def test_hangs_in_python_on_an_infinite_loop():
    subprocess.Popen(["sleep", "600"])
    while True:
        time.sleep(0.01)


def test_hangs_where_sigalrm_cannot_reach():
    r, w = os.pipe()
    subprocess.Popen(["sleep", "600"], stdout=w)
    os.close(w)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # as C code that never returns
    try:
        os.read(r, 1)  # returns (EOF) once the child is killed
    finally:
        os.close(r)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})


def test_the_run_goes_on():
    pass
"""

STUCK_FOR_GOOD = """
import os, signal


def test_blocked_for_good():
    r, w = os.pipe()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    os.read(r, 1)  # nobody ever writes: only the run's exit ends this
"""


def _start(tmp_path: Path, source: str, token: str) -> subprocess.Popen:
    tmp_path.mkdir()
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(textwrap.dedent("""\
        [pytest]
        addopts = -p no:cacheprovider -rfE
        timeout = 1
        timeout_method = signal
        """))
    (tmp_path / "test_inner.py").write_text(source)
    env = dict(os.environ, HARNESS_TOKEN=token, TMX_TEST_BACKSTOP_GRACE_S="1",
               TMX_TEST_LEAK_WAIT_S="0.5", PYTHONPATH=str(TESTS.parent), COLUMNS="400")
    return subprocess.Popen(["bash", "-c", f"{sys.executable} -m pytest -q & wait $!"],
                            cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_leaks_are_caught_and_hangs_are_ended(tmp_path):
    token = uuid.uuid4().hex
    start = time.monotonic()
    runs = _start(tmp_path / "a", INNER, token), _start(tmp_path / "b", STUCK_FOR_GOOD, token)
    try:
        (out, _), (stuck_out, _) = (run.communicate(timeout=120) for run in runs)
    finally:
        for run in runs:
            if run.poll() is None:
                os.killpg(run.pid, 9)
                run.wait()
        shm = Path("/dev/shm/tmx_harness_" + token)
        leaked_shm = shm.exists()
        shm.unlink(missing_ok=True)
    elapsed = time.monotonic() - start

    def outcome(kind: str, test: str, why: str) -> bool:
        return re.search(rf"^{kind} test_inner.py::{test} - .*{why}", out, re.M) is not None

    assert leaked_shm, out  # the entry was really left behind, and the check saw it:
    assert outcome("ERROR", "test_leaks_a_shm_entry", "left shared memory behind"), out
    assert outcome("ERROR", "test_leaks_an_fd", "left fds open"), out
    assert outcome("ERROR", "test_leaks_a_child", "left child processes behind"), out
    # Layer 1: SIGALRM ends a Python loop although SIGINT is ignored; the leak check then
    # kills the child the test left.
    assert outcome("FAILED", "test_hangs_in_python_on_an_infinite_loop", "Timeout"), out
    assert outcome("ERROR", "test_hangs_in_python_on_an_infinite_loop", "child processes"), out
    # Layer 2: the backstop kills what the blocked test waits on, and the timeout lands.
    assert re.search(r"test_hangs_where_sigalrm_cannot_reach: still running 1 s past its "
                     r"timeout; SIGKILL", out), out
    assert outcome("FAILED", "test_hangs_where_sigalrm_cannot_reach", "Timeout"), out
    assert re.search(r"^2 failed, 6 passed, 5 errors in", out, re.M), out
    # Layer 3: what nothing can unblock ends the run, with every thread's stack.
    assert runs[1].returncode == 1, stuck_out
    assert "Timeout (0:00:03)!" in stuck_out and "test_blocked_for_good" in stuck_out, stuck_out
    assert elapsed < 60, elapsed
