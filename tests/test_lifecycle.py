"""Where shared memory lives and when it goes: names, crashes, fd limits, a full /dev/shm."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import _workers
import pytest
import torch
from conftest import shm_entries

import torch_mp_ext as mp


@pytest.fixture
def file_system():
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    yield
    mp.set_sharing_strategy(before)


def names_of(pid: int) -> set[str]:
    return {n for n in shm_entries() if n.startswith(f"torch_{pid}_")}


def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_file_system_name_exists_while_alive_and_then_vanishes(file_system):
    """torch's test_fs: the name starts with torch_<creator pid> and goes after the storage.
    Note [Pooled names]: it stays pooled for reuse while the process keeps sharing, and goes
    with empty_cache() (or some seconds later: the next test)."""
    me = os.getpid()
    t = torch.full((4,), 1.0, dtype=torch.float64)
    assert names_of(me) == set()
    q = mp.get_context("fork").SimpleQueue()
    try:
        q.put(t)  # moved into a named segment now
        names = names_of(me)
        assert len(names) == 1
        u = q.get()
        assert torch.equal(u, t)
        del t, u
        v = torch.zeros(4, dtype=torch.float64)
        q.put(v)  # the pooled segment's block again: no new name
        assert names_of(me) == names
        assert torch.equal(q.get(), v)
        del v
        assert names_of(me) == names  # pooled, with no live block
        mp.empty_cache()
        assert names_of(me) == set()
    finally:
        q.close()


EXPIRY_SCRIPT = """
import os, time, torch, torch_mp_ext as mp
mp.set_sharing_strategy("file_system")
mine = lambda: [n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{os.getpid()}_")]
ctx = mp.get_context("fork")
q, go = ctx.Queue(), ctx.Event()
def map_and_wait(q, go):  # a live receiver keeps the segment mapped: the expiry decides
    float(q.get(timeout=60).sum())
    go.wait(60)
p = ctx.Process(target=map_and_wait, args=(q, go))
p.start()
kept = mp.empty(10)
t = mp.zeros(1 << 18)
assert len(mine()) == 2, mine()
q.put(t)
del t
while q.qsize():
    time.sleep(0.01)
time.sleep(0.2)  # the receiver has mapped it and dropped the tensor
started = time.monotonic()
while len(mine()) == 2 and time.monotonic() - started < 30:
    time.sleep(0.01)
waited = time.monotonic() - started
assert len(mine()) == 1, mine()  # the free segment went, the one with a live block stays
go.set()
p.join(60)
print(round(waited, 2))
"""


def test_file_system_names_of_free_segments_expire():
    """Note [Pooled names]: a named segment left with no live block that a live receiver
    maps goes by itself after TORCH_MP_EXT_NAMED_CACHE_S seconds; one with a live block
    stays (one nobody else maps goes at once: tests/test_pooled_names.py)."""
    env = dict(os.environ, TORCH_MP_EXT_NAMED_CACHE_S="1")
    done = subprocess.run([sys.executable, "-c", EXPIRY_SCRIPT], capture_output=True, text=True,
                          timeout=120, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-2000:]
    assert 0.7 <= float(done.stdout) < 5.0, done.stdout


def test_file_system_hand_offs_reuse_one_pooled_segment_and_its_mapping(file_system):
    """Note [Pooled names]: tensor after tensor, the sender's pool hands out the same named
    segment again and the receiver keeps its mapping: no new name, no new mapping."""
    me = os.getpid()
    ctx = mp.get_context("fork")
    q, acks = ctx.SimpleQueue(), ctx.SimpleQueue()
    p = ctx.Process(target=_workers.take_and_count_mappings, args=(q, acks, 10))
    p.start()
    try:
        names, mapped = [], []
        for i in range(10):
            t = mp.empty(1 << 18)
            t.fill_(i)
            q.put(t)
            del t
            ok, count = acks.get()
            assert ok
            mapped.append(count)
            names.append(frozenset(names_of(me)))
        assert len(names[0]) == 1 and set(names) == {names[0]}, names
        assert set(mapped[1:]) == {mapped[0]}, mapped
        p.join(60)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join(60)
        q.close()
        acks.close()


def test_file_system_names_go_with_their_storage_when_pooling_is_off():
    """TORCH_MP_EXT_NAMED_CACHE_S=0: each file_system block is a segment of its own whose name
    goes with its last reference, as in torch."""
    script = textwrap.dedent(
        """
        import os, torch, torch_mp_ext as mp
        mp.set_sharing_strategy("file_system")
        mine = lambda: [n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{os.getpid()}_")]
        q = mp.get_context("fork").SimpleQueue()
        q.put(torch.ones(4))
        assert len(mine()) == 1, mine()
        u = q.get()
        assert len(mine()) == 1, mine()
        del u
        assert mine() == [], mine()
        t, u = mp.empty(10), mp.empty(10)
        assert len(mine()) == 2, mine()  # one segment per block
        del t, u
        assert mine() == [], mine()
        q.close()
        print("ok")
        """
    )
    env = dict(os.environ, TORCH_MP_EXT_NAMED_CACHE_S="0")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_file_descriptor_strategy_leaves_no_names():
    before = shm_entries()
    t = mp.empty(1 << 16)
    assert shm_entries() == before
    del t


def test_sigkilled_sender_leaves_no_name_once_the_receiver_drops_it():
    ctx = mp.get_context("spawn")
    q, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_workers.send_named_and_wait, args=(q, e))
    p.start()
    t = q.get(timeout=60)
    assert t.eq(7).all() and len(names_of(p.pid)) == 1
    os.kill(p.pid, signal.SIGKILL)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    assert len(names_of(p.pid)) == 1  # our mapping keeps it alive and named
    del t  # the last live holder: the dead sender's reference no longer counts
    assert names_of(p.pid) == set()
    q.close()
    q.join_thread()


def test_sigkilled_sender_leaves_no_name_once_its_peers_exit():
    ctx = mp.get_context("spawn")
    q, e, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    sender = ctx.Process(target=_workers.send_named_and_wait, args=(q, e))
    sender.start()
    # The tensor is in flight in q: its name exists before put() returns, so wait for the
    # frame itself (a SIGKILL between the two lost the item, once, under load).
    assert wait_until(lambda: names_of(sender.pid) and q.qsize() == 1)
    os.kill(sender.pid, signal.SIGKILL)
    sender.join(60)
    peer = ctx.Process(target=_workers.receive_and_drop, args=(q, out))
    peer.start()
    assert out.get(timeout=60) == 7.0 * 1024  # a message outlives its SIGKILLed sender
    peer.join(60)
    assert peer.exitcode == 0
    assert names_of(sender.pid) == set()
    for queue in (q, out):
        queue.close()
        queue.join_thread()


def keeper_pids() -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if "(tmx-keeper)" in stat and stat[stat.rindex(")") + 2] != "Z":
            pids.add(int(entry))
    return pids


@pytest.mark.parametrize("nbytes", [4096, 8 << 20])
def test_a_worker_may_put_a_tensor_and_return_before_it_is_received(nbytes):
    """torch's file_descriptor strategy fails here (the sender's resource_sharer is gone)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    before = keeper_pids()
    p = ctx.Process(target=_workers.put_and_return, args=(q, nbytes))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    t = q.get(timeout=60)  # the worker is gone: its exit keeper hands out the segment
    assert t.numel() == nbytes // 4 and t.eq(3).all()
    # The keeper leaves once the segment is received; 60 s, not 10: on a loaded machine its
    # exit may wait seconds for a CPU (wait_until returns as soon as it is gone).
    assert wait_until(lambda: not (keeper_pids() - before), timeout=60)  # keeper left
    q.close()
    q.join_thread()


KEEPER_SCRIPT = """
import multiprocessing.reduction, os, time
import torch_mp_ext as mp

def pickle_and_exit():
    multiprocessing.reduction.ForkingPickler.dumps(mp.zeros(1024))  # a handle never redeemed

if __name__ == "__main__":
    p = mp.get_context("fork").Process(target=pickle_and_exit)
    p.start()
    p.join(60)
    time.sleep(0.5)  # the child's keeper serves while a member of its run lives
    print(p.exitcode, flush=True)
"""


@pytest.mark.slow  # a script whose child leaves a keeper: 5 s
def test_an_exit_keeper_does_not_outlive_the_run_that_could_ask_it(tmp_path):
    """Issue 36: a keeper waited for its handles up to TORCH_MP_EXT_EXIT_LINGER_S (30 s)
    after the whole run had ended, and "no leftover process" checks saw it. A handle can only
    be redeemed by a process of its run (Note [Session names]): with none left, the keeper
    leaves within a quarter of a second (Note [Exit keeper])."""
    script = tmp_path / "keeper.py"
    script.write_text(KEEPER_SCRIPT)
    before = keeper_pids()
    env = dict(os.environ, TORCH_MP_EXT_EXIT_LINGER_S="300",
               PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    env.pop("TORCH_MP_EXT_SESSION", None)  # a run of its own, not a member of the suite's
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        keepers: set[int] = set()
        assert wait_until(lambda: keepers.update(keeper_pids() - before) or keepers, timeout=60)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    assert out.strip() == "0"
    ended = time.monotonic()
    assert wait_until(lambda: not (keeper_pids() & keepers), timeout=60)
    # 300 s was its linger: it left because its run ended (10 s: a loaded machine's margin).
    assert time.monotonic() - ended < 10


def test_cleanup_reaps_names_of_dead_processes(file_system):
    """A segment named by nothing in flight, whose holders all died, is garbage."""
    script = textwrap.dedent(
        """
        import os, torch, torch_mp_ext as mp
        mp.set_sharing_strategy("file_system")
        t = mp.empty(100)
        print(os.getpid(), flush=True)
        os.kill(os.getpid(), 9)
        """
    )
    before = shm_entries()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == -signal.SIGKILL
    # Only the child's own names (torch_<pid>_...): another test run may be creating some.
    prefix = f"torch_{int(proc.stdout.split()[0])}_"
    pid_names = {n for n in shm_entries() - before if n.startswith(prefix)}
    assert pid_names  # the SIGKILLed process could not clean up
    out = subprocess.run([sys.executable, "-m", "torch_mp_ext", "cleanup"], capture_output=True,
                         text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert not (pid_names & shm_entries())
    for name in pid_names:
        assert name in out.stdout


def test_ten_thousand_live_tensors_under_a_low_fd_limit():
    """torch fails here with 'received 0 items of ancdata' (one fd per received storage)."""
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    count = 10_000
    p = ctx.Process(target=_workers.receive_many_under_fd_limit, args=(q, out, count, 256))
    p.start()
    sent = [torch.full((4,), float(i)) for i in range(count)]
    for t in sent:
        q.put(t)
    received, distinct, total, fds = out.get(timeout=300)
    p.join(120)
    assert p.exitcode == 0
    assert received == count and distinct == count
    assert total == sum(range(count))
    assert fds < 64
    del sent
    for queue in (q, out):
        queue.close()
        queue.join_thread()


@pytest.mark.no_leak_check
def test_out_of_fds_error_names_the_limit_and_the_fix():
    """A receiver already at its open-file limit: the error says so (docs/troubleshooting.md).

    The message the receiver could not rebuild still holds its block (as an undelivered
    message does), so this process keeps that segment: the leak check would count its fd.
    """
    ctx = mp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_workers.receive_at_fd_limit, args=(q, out))
    p.start()
    q.put(mp.empty(1 << 20))  # a segment of its own, made after the fork
    kind, message = out.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert kind == "SharedMemoryError", (kind, message)
    assert message.startswith("24 ")  # EMFILE
    assert "open-file limit (RLIMIT_NOFILE=" in message and "ulimit -n" in message
    for queue in (q, out):
        queue.close()
        queue.join_thread()
    assert not p.is_alive() and not mp.active_children()


def _in_small_dev_shm(script: str, size: str = "8m") -> subprocess.CompletedProcess:
    """Runs `script` in a private mount namespace whose /dev/shm is a small tmpfs."""
    shell = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} -c \"$0\""
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell, script],
        capture_output=True, text=True, timeout=120,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )


needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare(1) to mount a small tmpfs on a private /dev/shm",
)


@needs_unshare
def test_pages_of_released_blocks_are_back_before_the_next_allocation_fails():
    """Note [Unmapping off the caller's path]: large mappings are unmapped by a background
    thread, so right after a release the pages may still be held; an allocation that finds
    /dev/shm full waits for those unmaps and retries instead of failing."""
    script = textwrap.dedent(
        """
        import torch, torch_mp_ext as mp
        for strategy, backend in (("file_system", None), ("file_descriptor", "shm")):
            mp.set_sharing_strategy(strategy)
            if backend:
                mp._C.set_anonymous_backend(backend)
            for i in range(20):  # 40 MB of a 64 MB /dev/shm, again and again
                t = mp.empty(10 << 20)
                t.fill_(i)
                del t
                mp.empty_cache()
        print("ok")
        """
    )
    done = _in_small_dev_shm(script, "64m")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@needs_unshare
def test_free_file_system_segments_hold_at_most_a_quarter_of_dev_shm():
    """Note [Pooled names]: in a 64 MB /dev/shm, free named segments past 16 MB go at the next
    expiry tick, however long the idle time."""
    script = textwrap.dedent(
        """
        import os, time, torch, torch_mp_ext as mp
        mp.set_sharing_strategy("file_system")
        def used():
            st = os.statvfs("/dev/shm")
            return (st.f_blocks - st.f_bfree) * st.f_frsize
        ts = [mp.empty(1 << 20) for _ in range(6)]  # six 4 MB segments: 24 MB
        before = used()
        del ts
        time.sleep(1.0)
        print(before >> 20, used() >> 20)
        """
    )
    env_script = "import os; os.environ['TORCH_MP_EXT_NAMED_CACHE_S'] = '600'\n" + script
    done = _in_small_dev_shm(env_script, "64m")
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = map(int, done.stdout.split())
    assert before >= 24 and after <= 17, done.stdout  # 16 MB of segments, plus headers


@needs_unshare
def test_full_dev_shm_is_a_clear_error_at_allocation_never_sigbus():
    script = textwrap.dedent(
        """
        import errno, torch, torch_mp_ext as mp
        from multiprocessing.reduction import ForkingPickler
        from torch_mp_ext import _C
        from torch_mp_ext.errors import SharedMemoryError
        mp.set_sharing_strategy("file_system")
        for make in (lambda: mp.empty(4 << 20),                          # 16 MB > 8 MB
                     lambda: ForkingPickler.dumps(torch.ones(4 << 20))):  # moved on send
            try:
                make()
            except SharedMemoryError as e:
                assert isinstance(e, OSError) and e.errno == errno.ENOSPC, e
                assert "bytes (16.0 MiB)" in str(e) and "--shm-size" in str(e), str(e)
                assert "/dev/shm/torch_" in e.filename, e.filename
                print("fs:", e)
            else:
                raise SystemExit("no error")
        mp.set_sharing_strategy("file_descriptor")
        _C.set_anonymous_backend("shm")  # torch's way: counts against /dev/shm
        try:
            mp.empty(4 << 20)
        except SharedMemoryError as e:
            assert e.errno == errno.ENOSPC and "--shm-size" in str(e)
            print("fd/shm:", e)
        else:
            raise SystemExit("no error")
        _C.set_anonymous_backend("memfd")  # the default: not bounded by /dev/shm
        t = mp.empty(16 << 20)
        t.fill_(1)
        print("memfd ok", float(t.sum()))
        """
    )
    proc = _in_small_dev_shm(script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fs:" in proc.stdout and "fd/shm:" in proc.stdout
    assert "memfd ok 16777216.0" in proc.stdout
