"""Hostile limits, real ones (issue 35): a full /dev/shm (a private tmpfs in a mount
namespace of its own), rlimits set in a fresh interpreter, requests beyond memory, a root
SIGKILLed, fork children racing close(), and argument errors. Each case runs in a fresh
interpreter (tests/_limits_workers.py) and must end without a signal."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import torch_mp_ext as mp
from torch_mp_ext import _C

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "_limits_workers.py")
TIMEOUT = 240
TABLE = "tmx_999999_session_00000000deadbeef"  # a half-made table (magic 0) of a dead root


def _root_env() -> dict:
    """A new run's environment: the child is a session root, not a member of ours."""
    env = dict(os.environ)
    env.pop("TORCH_MP_EXT_SESSION", None)
    return env


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=TIMEOUT,
                          env=_root_env(), cwd=HERE)


def _unshare_available() -> str:
    if os.geteuid() != 0:
        return "needs root to mount a private tmpfs over /dev/shm (unshare -m)"
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    return ""


needs_unshare = pytest.mark.skipif(bool(_unshare_available()), reason=_unshare_available())


def _on_full_dev_shm(command: str) -> subprocess.CompletedProcess:
    """Runs `command` (sh) with /dev/shm a private 8 MiB tmpfs, filled up first, holding a
    half-made session table of a dead root; the mount goes with the namespace."""
    script = ("mount -t tmpfs -o size=8m tmpfs /dev/shm && "
              f"truncate -s 1056 /dev/shm/{TABLE} && touch -d '-1 hour' /dev/shm/{TABLE} && "
              "{ dd if=/dev/zero of=/dev/shm/fill bs=64k 2>/dev/null || true; } && "
              f"{command}")
    return _run("unshare", "-m", "--propagation", "private", "sh", "-c", script)


def _ok(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, f"rc {out.returncode}\n{out.stdout}\n{out.stderr}"
    assert "ok" in out.stdout.split(), out.stdout + out.stderr


# ---- D1: a full /dev/shm ----------------------------------------------------------------


@pytest.mark.slow  # two interpreters on a full private /dev/shm: 4 s
@needs_unshare
def test_full_dev_shm_imports_and_file_descriptor_works():
    _ok(_on_full_dev_shm(f"{sys.executable} {WORKERS} full_dev_shm"))


@needs_unshare
def test_cleanup_on_full_dev_shm_removes_half_made_tables():
    # (cleanup's own import, a new root, already sweeps it: reap_dead_sessions either way)
    out = _on_full_dev_shm(f"{sys.executable} -m torch_mp_ext cleanup && ls /dev/shm")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "segment(s) whose processes are all gone" in out.stdout, out.stdout
    assert out.stdout.split()[-1] == "fill" and TABLE not in out.stdout.split()[-2:], out.stdout


@needs_unshare
def test_new_root_sweeps_half_made_tables_on_full_dev_shm():
    # a recent one may be a root of another pid namespace writing it: kept (10 s)
    fresh = "tmx_999998_session_00000000feedf00d"
    out = _on_full_dev_shm(f"truncate -s 0 /dev/shm/{fresh} && {sys.executable} {WORKERS} "
                           f"just_import && ls /dev/shm")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["ok", "fill", fresh], out.stdout


# ---- D2, D6: requests beyond memory, the file-size limit -------------------------------


def test_request_beyond_memory_raises_at_once():
    _ok(_run(sys.executable, WORKERS, "beyond_memory"))


def _child_memory_cgroup(limit: int) -> str:
    """A new memory cgroup under this process's (v1, or v2 with the controller on) limited to
    ``limit`` bytes; "" where none can be made here."""
    from torch_mp_ext.sharing.limits import cgroup_memory_dirs

    for version, parent in cgroup_memory_dirs():
        path = os.path.join(parent, f"tmx_test_{os.getpid()}")
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, "memory.max" if version == 2
                                   else "memory.limit_in_bytes"), "w") as f:
                f.write(str(limit))
            return path
        except OSError:
            os.rmdir(path)
    return ""


def test_request_beyond_the_cgroup_limit_raises_at_once():
    path = _child_memory_cgroup(1 << 30)
    if not path:
        pytest.skip("no memory cgroup can be made here (needs root and a writable cgroupfs)")
    try:
        out = _run("sh", "-c", f"echo $$ > {path}/cgroup.procs && exec {sys.executable} "
                               f"{WORKERS} beyond_cgroup")
        _ok(out)
        assert path in out.stdout, out.stdout  # the message names the cgroup
    finally:
        os.rmdir(path)  # its one process has exited


def test_queues_work_under_a_file_size_limit():
    _ok(_run(sys.executable, WORKERS, "file_size_limit"))


# ---- D7: the session table of a dead root -----------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_dead_roots_session_table_is_swept_by_the_next_root(sig):
    """A root killed by a scheduler's SIGTERM runs no exit handler either (issue 26)."""
    root = subprocess.Popen([sys.executable, WORKERS, "import_and_sleep"], stdout=subprocess.PIPE,
                            text=True, env=_root_env(), cwd=HERE)
    try:
        tag, pid = root.stdout.readline().strip().split(":")
        table = f"tmx_{pid}_session_{tag}"
        assert table in os.listdir("/dev/shm")
    finally:
        root.send_signal(sig)
        root.wait(TIMEOUT)
        root.stdout.close()
    assert root.returncode == -sig
    assert table in os.listdir("/dev/shm")  # nobody of that run was left to remove it
    _ok(_run(sys.executable, WORKERS, "just_import"))
    assert table not in os.listdir("/dev/shm")


# ---- D0: close() right after put() never loses the item ---------------------------------


@pytest.mark.parametrize("order", ["put_start_close", "start_put_close"])
def test_close_after_put_delivers_to_child(ctx, order):
    import _limits_workers as workers

    # A fork child whose at-fork handlers run late: before the fix the parent's close()
    # drained the item every time (Note [Fork children hold before they run]).
    _C._set_fork_child_delay(200 if ctx.get_start_method() == "fork" else 0)
    try:
        for _ in range(3 if ctx.get_start_method() == "fork" else 2):
            _close_after_put_once(ctx, order, workers)
    finally:
        _C._set_fork_child_delay(0)


def _close_after_put_once(ctx, order, workers) -> None:
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=workers.reads_one, args=(q, out))
    if order == "put_start_close":
        q.put(42)
        p.start()
    else:
        p.start()
        q.put(42)
    q.close()  # this process puts no more; the item is the child's
    try:
        assert out.get(timeout=workers.TIMEOUT) == ("ok", 42)
    finally:
        p.join(workers.TIMEOUT)
    assert p.exitcode == 0
    out.close()


# ---- D5 and argument errors ---------------------------------------------------------------


def test_wait_on_no_refs_raises():
    with pytest.raises(ValueError, match="num_returns must be between 1 and len"):
        mp.wait([], num_returns=1)
    with pytest.raises(TypeError, match="num_returns must be an integer"):
        mp.wait([], num_returns="1")


def test_argument_errors_in_our_words():
    with pytest.raises(TypeError, match=r"is_shared\(\) takes a tensor or a numpy array, got int"):
        mp.is_shared(5)
    with pytest.raises(ValueError, match="sizes must be non-negative integers"):
        mp.empty_array(-1)
    assert mp.empty_array(3, np.int8).shape == (3,)
    assert not mp.is_shared(torch.ones(2)) and mp.is_shared(mp.empty(2))
    q = mp.Queue()
    try:
        with pytest.raises(TypeError, match="max_items must be an integer, got str"):
            q.get_many("3")
    finally:
        q.close()
