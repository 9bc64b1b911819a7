"""The raw ring (torch_mp_ext._C.Ring): framing, limits, waits, holders, and crash points."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from torch_mp_ext import _C
from torch_mp_ext.errors import CorruptSegmentError
from torch_mp_ext.sharing import memory as _memory

OK, EMPTY, FULL, TIMEOUT, CLOSED = (int(s) for s in (
    _C.Status.Ok, _C.Status.Empty, _C.Status.Full, _C.Status.Timeout, _C.Status.Closed))


def new_ring(capacity=4096, maxsize=0, joinable=False):
    block = _memory.allocate(_C.Ring.footprint(capacity))
    return _C.Ring.create(block, capacity, maxsize, joinable)


def take(ring, timeout=0.0):
    """(tag, payload) of the next frame, or the status."""
    r = ring.get(timeout)
    if isinstance(r, bytes):
        return 0, r
    return r


def test_fifo_across_many_wraps_with_every_frame_size():
    ring = new_ring(1000)
    rng = random.Random(0)
    expected = []
    for i in range(3000):
        payload = bytes([i % 256]) * rng.randrange(0, 200)
        assert ring.put(payload, i % 7, 0.0) == OK
        expected.append((i % 7, payload))
        if ring.counts()[1] > 600 or i == 2999:
            while expected:
                assert take(ring) == expected.pop(0)
    assert ring.counts()[:2] == (0, 0)
    assert take(ring) == EMPTY


def test_capacity_is_exact_and_oversize_is_a_value_error():
    ring = new_ring(64)
    assert ring.capacity == 64
    assert ring.put(b"x" * 56, 0, 0.0) == OK  # 8-byte header + 56: exactly full
    assert ring.put(b"", 0, 0.0) == FULL
    take(ring)
    with pytest.raises(ValueError, match="can never fit"):
        ring.put(b"x" * 57, 0, 0.0)
    with pytest.raises(ValueError, match="can never fit"):
        ring.put_many([b"x" * 24, b"x" * 24, b"x" * 24], None, 0.0)


def test_maxsize_limits_frames():
    ring = new_ring(4096, maxsize=2)
    assert ring.put(b"a", 0, 0.0) == OK
    assert ring.put(b"b", 0, 0.0) == OK
    assert ring.put(b"c", 0, 0.0) == FULL
    with pytest.raises(ValueError, match="maxsize"):
        ring.put_many([b"1", b"2", b"3"], None, 0.0)


def test_put_many_is_all_or_nothing_and_get_many_takes_what_is_there():
    ring = new_ring(128)
    assert ring.put_many([b"a" * 40, b"b" * 40], [1, 2], 0.0) == OK  # 96 bytes used
    assert ring.put_many([b"c", b"d", b"e", b"f"], None, 0.0) == FULL  # 64 > 32 left
    assert ring.qsize() == 2
    status, payloads, tags = ring.get_many(10, 0.0)
    assert (status, payloads, tags) == (OK, [b"a" * 40, b"b" * 40], [1, 2])
    assert ring.get_many(10, 0.0)[0] == EMPTY


def test_timeouts_are_honoured():
    ring = new_ring(64)
    t0 = time.monotonic()
    assert ring.get(0.2) == EMPTY
    assert 0.18 <= time.monotonic() - t0 < 2.0
    ring.put(b"x" * 56, 0, 0.0)
    t0 = time.monotonic()
    assert ring.put(b"y", 0, 0.2) == FULL
    assert 0.18 <= time.monotonic() - t0 < 2.0


def test_blocked_get_releases_the_gil_and_wakes_on_put():
    ring = new_ring()
    got = []
    t = threading.Thread(target=lambda: got.append(ring.get(10.0)))
    t.start()
    time.sleep(0.1)  # this thread runs Python while the other waits: the GIL is free
    assert ring.put(b"hello", 0, 0.0) == OK
    t.join(10)
    assert got == [b"hello"]


def test_close_wakes_this_objects_waiters_and_drain_ignores_it():
    ring = new_ring()
    results = []
    t = threading.Thread(target=lambda: results.append(ring.get(10.0)))
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    ring.close()
    t.join(10)
    assert results == [CLOSED] and time.monotonic() - t0 < 2.0
    assert ring.put(b"x", 0, 0.0) == CLOSED
    other = _C.Ring.open(_C.attach(ring.share()))  # another holder is not closed
    assert other.put(b"y", 5, 0.0) == OK
    assert ring.drain() == [(5, b"y")]
    other.detach()


def test_holders_count_and_the_last_one_is_told():
    ring = new_ring()
    assert ring.holders == 1
    second = _C.Ring.open(_C.attach(ring.share()))
    assert ring.holders == 2
    assert second.detach() is False
    assert second.detach() is False  # idempotent per object
    assert ring.detach() is True
    assert ring.holders == 0


def test_open_refuses_memory_that_is_not_a_ring():
    block = _memory.allocate(4096)
    memoryview(block)[:64] = b"\0" * 64
    with pytest.raises(CorruptSegmentError):
        _C.Ring.open(block)


def test_joinable_counts_unfinished_tasks():
    ring = new_ring(joinable=True)
    ring.put_many([b"1", b"2"], None, 0.0)
    assert ring.counts()[2] == 2
    assert ring.join(0.05) == TIMEOUT
    assert ring.task_done() == OK and ring.task_done() == OK
    assert ring.task_done() == EMPTY  # too many
    assert ring.join(0.0) == OK


# ---- crash points: a process killed at each step of Note [Ring commit] --------------------

CRASHES = [
    # (crash point, operation, is the victim's frame visible afterwards)
    (1, "put", False),  # killed holding the mutex, before writing
    (2, "put", False),  # frame written, journal written, not committed
    (3, "put", True),   # committed, state not yet updated: the repair finishes the put
    (4, "get", True),   # frame copied out, not committed: still there for the next getter
    (5, "get", False),  # committed: consumed by the process that died
]


@pytest.fixture(scope="module")
def crash_outcomes():
    """Runs every crash scenario in one fresh interpreter (tests/_ring_crash.py)."""
    tests_dir = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tests_dir.parent), str(tests_dir), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(tests_dir / "_ring_crash.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("point,op,visible", CRASHES)
def test_a_process_killed_at_each_commit_step_leaves_the_ring_consistent(
        crash_outcomes, point, op, visible):
    out = crash_outcomes[f"{point}-{op}"]
    assert out["exitcode"] == -9  # SIGKILLed at the crash point, not exited
    assert out["put_after"] == OK  # the survivors go on: that put repaired the ring
    assert out["recoveries"] == 1 and not out["broken"]
    if op == "put":
        expected = [[1, "first"]] + ([[0, "second" * 5]] if visible else []) + [[3, "third"]]
    else:
        expected = ([[1, "first"]] if visible else []) + [[3, "third"]]
    assert out["frames"] == expected
    assert out["holders"] == 2  # the victim could not let go of its holder


def test_waiters_survive_a_holder_killed_with_the_mutex(crash_outcomes):
    out = crash_outcomes["hold"]
    assert out["exitcode"] == -9
    assert out["put_after"] == OK and out["got"] == "after" and out["recoveries"] == 1
