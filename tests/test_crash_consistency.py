"""Crash consistency (issue 12): any process may die at any instruction, and nothing else
breaks. Real processes, real SIGKILLs; after each kill a fresh queue / pool in this process
must deliver exactly what was sent.

The kill-anywhere harness runs twice per strategy: a short run with a fixed seed in the fast
tier (the same kills every run: a failure is a regression), and a longer one with a random
seed in the slow tier (``--slow``). ``TMX_KILL_LONG=1`` makes that one the long,
nightly-style run (more rounds)."""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import pickle
import queue
import random
import select
import signal
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import _crash_workers as cw
import numpy as np
import pytest

import torch_mp_ext as mp
from torch_mp_ext.errors import WorkerDiedError
from torch_mp_ext.queues import compat as qc

LONG = os.environ.get("TMX_KILL_LONG", "") not in ("", "0")
T = 30.0  # seconds: the most any single wait may take


@pytest.fixture
def strategy(request):
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy(request.param)
    yield request.param
    mp.set_sharing_strategy(before)


def wait_until(predicate, timeout=T):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


# ---- the audit (Note [Audit] in csrc/shm/audit.cpp) -------------------------------------

AUDIT_SCRIPT = """
import torch_mp_ext as mp
from torch_mp_ext import _C
b = _C.allocate(100)
assert _C.audit() == [], _C.audit()
h = b.share()
assert _C.audit() == [], _C.audit()
_C.release_handle(h)
# A peer that drops a reference it does not hold: a handle released twice, its spent ticket
# (Note [Tickets]) forged back first. The block is freed under b.
import ctypes
layout = dict((name, (offset, size)) for name, offset, size in _C.segment_layout())
def field(name):
    return ctypes.c_uint64.from_address(b.segment_address + layout[name][0]).value
index = (b.address - b.segment_address - field("data_offset")) // field("block_size")
slot_size = layout["slots"][1]
tickets = ctypes.c_uint64.from_address(
    b.segment_address + layout["slots"][0] + index * slot_size + slot_size - 8)
tickets.value += 1
_C.release_handle(h)
print(_C.audit())
"""


def test_the_audit_sees_a_block_freed_while_referenced():
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", AUDIT_SCRIPT], capture_output=True,
                          text=True, timeout=T, env=env)
    assert done.returncode == 0, done.stderr
    report = done.stdout
    assert "is on the free stack with refcount" not in report  # refcount 0 there: consistent
    assert "is referenced here but its refcount is 0" in report, report
    assert "is on the free stack but a process holds it" in report, report


# ---- fork: the child's references are counted before it exists (Note [Mappings and fork]) ----

FORK_RACE_SCRIPT = """
import os, time
from torch_mp_ext import _C
b = _C.allocate(100)
_C._set_fork_child_delay(300)  # the child's atfork handler runs late
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, b"x")  # its handler has run: it holds b
    time.sleep(60)
    os._exit(0)
del b  # the parent lets go at once, before the child's handler ran
os.read(r, 1)
print("live child:", _C.audit(reclaim=False))
os.kill(pid, 9)
os.waitpid(pid, 0)
print("dead child:", _C.audit())
"""


def test_a_parent_letting_go_right_after_fork_never_frees_the_childs_block():
    """The parent resumes as soon as fork() returns; it once dropped its last reference to a
    block before the child's atfork handler counted the child's own, so the block went back to
    the free stack while the child held it (issue 12: found by killing TaskPool workers, whose
    replacements are forked while the parent lets task values go)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", FORK_RACE_SCRIPT], capture_output=True,
                          text=True, timeout=T, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["live child: []", "dead child: []"], done.stdout


# ---- queue rings held by a dead process (Note [Ring holders are not block references]) ----


def test_a_killed_holder_of_two_queue_objects_does_not_free_the_ring():
    """A process holding one ring through two queue objects has one counted reference to its
    block. Once, its death freed the ring under the live holders: the next queue created got
    the same memory and the two queues delivered each other's items."""
    ctx = mp.get_context("fork")
    q, ready = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=cw.hold_queue_twice_then_sleep, args=(q, ready))
    child.start()
    assert ready.get(timeout=T) == child.pid
    os.kill(child.pid, signal.SIGKILL)
    child.join(T)
    pickle.loads(ForkingPickler.dumps(q)).close()  # a holder letting go reaps the dead one
    fresh = mp.Queue()
    fresh.put("fresh")
    q.put("q")
    assert q.get(timeout=T) == "q" and fresh.get(timeout=T) == "fresh"
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    assert mp._C.audit() == []
    q.close(), ready.close(), fresh.close()


# ---- TaskPool: workers killed and replaced, again and again --------------------------------

POOL_CASES = [("fork", "file_descriptor", 20), ("forkserver", "file_system", 20),
              ("fork", "file_system", 20), ("forkserver", "file_descriptor", 20)]


@pytest.mark.parametrize("start_method, strategy, rounds", POOL_CASES,
                         indirect=["strategy"], ids=[f"{m}-{s}" for m, s, _ in POOL_CASES])
def test_task_pool_keeps_running_tasks_through_kill_and_replace(start_method, strategy, rounds):
    """Each round SIGKILLs a busy worker: its task fails naming the signal, the pool starts a
    replacement, and tasks moving tensors and arrays both ways keep returning exact data."""
    with mp.TaskPool(2, start_method=start_method) as pool:
        for r in range(rounds):
            flag = mp.zeros_array(1, np.int64)
            doomed = pool.submit(cw.signal_then_sleep, flag, 60)
            wait_until(lambda flag=flag: flag[0] != 0)
            os.kill(int(flag[0]), signal.SIGKILL)
            with pytest.raises(WorkerDiedError, match="SIGKILL"):
                doomed.get(timeout=T)
            refs = [pool.submit(cw.tagged_values, 3, 10 * k) for k in range(4)]
            for k, values in enumerate(mp.get(refs, timeout=T)):
                assert cw.wrong(values, 10 * k) == 0, (r, k, values)
            sent = [cw.tagged(100 + k) for k in range(4)]
            back = mp.get([pool.submit(cw.identity, x) for x in sent], timeout=T)
            assert cw.wrong(back, 100) == 0, (r, back)
            assert len(pool.pids) == 2
            assert mp._C.audit() == [], r


# ---- SimpleQueue's doorbell (Note [Doorbell]) ---------------------------------------------


def _readable(fd, timeout):
    return bool(select.select([fd], [], [], timeout)[0])


@pytest.mark.parametrize("point, op", [(qc.CRASH_RING_NO_BYTE, "put"),
                                       (qc.CRASH_GET_DRAINED, "get")],
                         ids=["put-took-the-word", "get-drained-the-pipe"])
def test_a_process_killed_inside_the_doorbell_protocol_never_wedges_wait(point, op):
    """The killed process left an item queued, the doorbell word naming it, and no byte.
    wait() on _reader (it asks for fileno() first) and any survivor's put repair that."""
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()
    q._reader.fileno()  # someone watches the pipe: the doorbell is on (Note [Doorbell])
    if op == "get":
        q.put("taken by the victim")
        q.put("left for us")
    victim = ctx.Process(target=cw.die_in_doorbell, args=(q, point, op))
    victim.start()
    victim.join(T)
    assert victim.exitcode == -signal.SIGKILL
    assert q._ring.qsize() == 1 and q._ring.doorbell_owner == victim.pid
    assert not _readable(q._doorbell[0], 0)  # what wedged wait() before
    assert multiprocessing.connection.wait([q._reader], timeout=T) == [q._reader]
    assert q.get() in ("from the dead", "left for us")
    assert not _readable(q._doorbell[0], 0)
    # The same death with no wait() in between: the next put by a survivor rings.
    victim = ctx.Process(target=cw.die_in_doorbell, args=(q, qc.CRASH_RING_NO_BYTE, "put"))
    victim.start()
    victim.join(T)
    q.put("survivor")
    assert _readable(q._doorbell[0], T)
    assert [q.get(), q.get()] == ["from the dead", "survivor"]
    assert mp._C.audit() == []
    q.close()


# ---- file_system names of dead processes (Note [Reclaiming names at run time]) -------------


def _names_of(pid):
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{pid}_")]


@pytest.mark.parametrize("strategy", ["file_system"], indirect=True)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_killed_childs_unsent_tensors_are_unlinked_once_it_is_joined(start_method, strategy):
    ctx = mp.get_context(start_method)
    ready = ctx.Queue()
    child = ctx.Process(target=cw.make_tensors_then_die, args=(3, ready))
    child.start()
    pid = ready.get(timeout=T)
    wait_until(lambda: child.exitcode is not None)
    # Nobody else ever mapped them: under file_system, a slab per size class (Note [Pooled
    # names]) for the six live blocks, and the freed block's segment, cached for reuse.
    assert len(_names_of(pid)) == 3
    child.join(T)  # the parent learns of the death: the names go, with the program running
    assert _names_of(pid) == []
    assert mp._C.audit() == []
    ready.close()


# ---- names lost in flight go with the run (Note [Session names] in csrc/shm/session.h) ----

SESSION_SCRIPT = """
import os
import _crash_workers as cw
import torch_mp_ext as mp
mp.set_sharing_strategy("file_system")
ctx = mp.get_context("fork")
q = ctx.Queue()
for i in range(4):
    q.put(cw.tagged(i))
taker = ctx.Process(target=cw.consume, args=(q, 4, 5))  # killed once its get committed
taker.start()
taker.join(30)
sender = ctx.Process(target=cw.produce_tagged, args=(q, 4, 2))  # killed before its commit
sender.start()
sender.join(30)
def names(pid):
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{pid}_")]
print(os.getpid(), sender.pid, taker.exitcode, sender.exitcode, len(names(os.getpid())),
      len(names(sender.pid)))
q.close()
"""


def test_names_of_messages_lost_in_flight_are_gone_once_the_run_exits():
    """A consumer killed after its get committed takes the item's handles with it; a sender
    killed before its put committed had pickled its handles already. Their names are counted
    in flight, so nothing may unlink them while the run lives; once every process of the run
    has exited, /dev/shm holds nothing of it, with no cleanup command."""
    tests_dir = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tests_dir.parent), str(tests_dir), os.environ.get("PYTHONPATH", "")]))
    env.pop("TORCH_MP_EXT_SESSION", None)  # the script is a run of its own, not ours
    done = subprocess.run([sys.executable, "-c", SESSION_SCRIPT], capture_output=True,
                          text=True, timeout=T, env=env)
    assert done.returncode == 0, done.stderr
    root, sender, taken, sent, root_names, sender_names = map(int, done.stdout.split())
    assert (taken, sent) == (-signal.SIGKILL, -signal.SIGKILL)
    assert root_names >= 1 and sender_names >= 1, done.stdout  # lost in flight, while it ran
    left = [n for n in os.listdir("/dev/shm")
            if n.startswith((f"torch_{root}_", f"torch_{sender}_", f"tmx_{root}_"))]
    assert left == []


KILLED_ROOT_SCRIPT = SESSION_SCRIPT.replace("q.close()", "os.kill(os.getpid(), 9)")

EXEC_CHILD_SCRIPT = """
import os, torch_mp_ext
pid = os.fork()  # the atfork handler makes the child a member of the session
if pid == 0:
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    os.dup2(null, 2)  # the test reads the run's output to its end
    os.execv("/bin/sleep", ["sleep", "30"])  # as torch starts torch_shm_manager
print(os.getpid(), pid)
"""


def test_a_members_fork_that_execs_another_program_does_not_keep_the_session():
    """torch's file_system strategy forks torch_shm_manager from a member and execs it; it
    outlived the run (the test suite's root) and the run's member table stayed in /dev/shm.
    A process without this extension mapped can hold no handle: the run still sweeps."""
    env = dict(os.environ)
    env.pop("TORCH_MP_EXT_SESSION", None)
    done = subprocess.run([sys.executable, "-c", EXEC_CHILD_SCRIPT], capture_output=True,
                          text=True, timeout=T, env=env)
    assert done.returncode == 0, done.stderr
    root, sleeper = map(int, done.stdout.split())
    try:
        os.kill(sleeper, 0)  # still running when the run ended
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"tmx_{root}_session_")]
        assert left == []
    finally:
        os.kill(sleeper, signal.SIGKILL)


def test_cleanup_sweeps_a_run_whose_last_process_was_killed():
    """The run's last process was SIGKILLed, so nobody swept its names: `cleanup` finds its
    session with no live member and removes them, and the session's table, with no
    --include-inflight (nothing can redeem a handle of a run that is over)."""
    tests_dir = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tests_dir.parent), str(tests_dir), os.environ.get("PYTHONPATH", "")]))
    env.pop("TORCH_MP_EXT_SESSION", None)
    done = subprocess.run([sys.executable, "-c", KILLED_ROOT_SCRIPT], capture_output=True,
                          text=True, timeout=T, env=env)
    assert done.returncode == -signal.SIGKILL, done.stderr
    root, sender = map(int, done.stdout.split()[:2])

    def left():
        return [n for n in os.listdir("/dev/shm")
                if n.startswith((f"torch_{root}_", f"torch_{sender}_", f"tmx_{root}_"))]

    assert any(n.startswith(f"tmx_{root}_session_") for n in left()), left()
    assert len(left()) >= 3, left()  # the table and the names lost in flight
    out = subprocess.run([sys.executable, "-m", "torch_mp_ext", "cleanup"], capture_output=True,
                         text=True, timeout=T, env=env)
    assert out.returncode == 0, out.stderr
    assert left() == [], (left(), out.stdout)


# ---- the kill-anywhere harness (tests/_kill_anywhere.py) ------------------------------------

HARNESS_ROUNDS = {"file_descriptor": 2000 if LONG else 200, "file_system": 500 if LONG else 100}
SHORT_ROUNDS = {"file_descriptor": 30, "file_system": 15}
SHORT_SEED = 20240527  # the fast tier's run: the same kills every time


@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
@pytest.mark.parametrize("run", ["short", pytest.param("long", marks=pytest.mark.slow)])
def test_kill_anywhere(strategy_name, run):
    """Random SIGKILLs and deterministic crash points across queues (producers, consumers,
    wait() readiness, tensors and arrays in the items), pipelines, TaskPool workers and a
    channel writer; after each kill a fresh queue delivers exact data and the audit is clean;
    once the harness has exited, /dev/shm holds nothing of it (file_system: names of messages
    lost in flight too, Note [Session names])."""
    if run == "short":
        seed, rounds = SHORT_SEED, SHORT_ROUNDS[strategy_name]
    else:
        seed, rounds = random.randrange(1 << 30), HARNESS_ROUNDS[strategy_name]
    tests_dir = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tests_dir.parent), str(tests_dir), os.environ.get("PYTHONPATH", "")]))
    env.pop("TORCH_MP_EXT_SESSION", None)  # a run of its own (Note [Session names])
    done = subprocess.run([sys.executable, str(tests_dir / "_kill_anywhere.py"), str(rounds),
                           str(seed), strategy_name], env=env, capture_output=True, text=True,
                          timeout=120 + rounds)
    assert done.returncode == 0, f"seed {seed}: {done.stderr[-3000:]}"
    r = json.loads(done.stdout)
    context = f"seed {seed}: {r}"
    assert r["kills"] >= rounds // 2, context
    assert r["wrong"] == 0 and r["wedges"] == 0 and r["violations"] == [], context
    assert r["unfinished_mismatch"] == 0 and r["pipeline_no_signal"] == 0, context
    left = [n for n in os.listdir("/dev/shm") if n.startswith(("tmx_", "torch_"))
            and any(n.startswith((f"torch_{pid}_", f"tmx_{pid}_")) for pid in r["pids"])]
    assert left == [], context  # file_system too: the run's last process swept its names
