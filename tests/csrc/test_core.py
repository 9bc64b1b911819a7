"""The raw C++ core through torch_mp_ext._C: blocks, handles, errors, fds, counters, reaping."""

from __future__ import annotations

import errno
import inspect
import mmap
import os
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

import _workers
import pytest

import torch_mp_ext as mp
from torch_mp_ext import _C
from torch_mp_ext.errors import CorruptSegmentError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_handles_carry_references_that_attach_adopts_and_release_drops():
    block = _C.allocate(100)
    assert block.refcount == 1 and block.capacity == 512 and not block.named
    h1, h2 = block.share(), block.share()
    assert block.refcount == 3
    other = _C.attach(h1)
    # One counted reference per process (Note [Dead holders]): the adopted one is extra here.
    assert other.address == block.address and block.refcount == 2
    _C.release_handle(h2)
    assert block.refcount == 1
    del other
    assert block.refcount == 1
    del block


@pytest.mark.parametrize("size", [100, 1 << 20], ids=["slab", "dedicated"])
def test_references_of_a_sigkilled_receiver_are_reclaimed(size):
    """The owner gets blocks back from receivers that died without letting go."""
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    block = _C.allocate(size)
    address = block.address
    p = ctx.Process(target=_workers.hold_block_then_die, args=(block.share(), q))
    p.start()
    assert q.get() == "holding"
    assert block.refcount == 2
    os.kill(p.pid, signal.SIGKILL)
    p.join(60)
    del block  # the owner lets go; the dead receiver's reference still pins the block
    if size == 100:
        assert _C.reclaim_dead_holders() >= 1  # ours, and the queue's ring it held
        assert _C.allocate(size).address == address
    else:  # a dry pool wakes the owner's reclaim thread (Note [Reclaiming off the
        # allocation path]): the block comes back within its interval, not on the allocation
        held, deadline = [], time.monotonic() + 30
        while True:
            held.append(_C.allocate(size))  # held: each miss makes a new segment
            if held[-1].address == address:
                break
            assert time.monotonic() < deadline, "the dead receiver's block never came back"
            time.sleep(0.05)
        assert len(held) <= 30, len(held)
        del held
    q.close()


def test_a_handle_used_twice_is_reported_stale_after_the_block_is_reused():
    block = _C.allocate(100)
    handle = block.share()
    _C.release_handle(handle)
    address = block.address
    del block
    again = _C.allocate(100)
    assert again.address == address  # recycled, with a new generation
    with pytest.raises(CorruptSegmentError, match="stale handle"):
        _C.attach(handle)


def test_not_our_segment_is_corrupt_segment_error():
    name = f"/torch_{os.getpid()}_notours"
    path = "/dev/shm" + name
    with open(path, "wb") as f:
        f.write(b"\0" * 8192)
    try:
        handle = (True, 1, 0, 8192, 0, 1, os.getpid(), name)
        with pytest.raises(CorruptSegmentError, match="not a torch_mp_ext segment"):
            _C.attach(handle)
    finally:
        os.unlink(path)


def test_syscall_errors_are_oserror_subclasses_with_errno_and_resource():
    with pytest.raises(FileNotFoundError) as info:
        _C.attach((True, 1, 0, 8192, 0, 1, 1, "/torch_1_doesnotexist"))
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == "/dev/shm/torch_1_doesnotexist"
    assert "shm_open" in str(info.value)


def test_the_fd_server_refuses_a_wrong_secret():
    block = _C.allocate(100)
    h = block.share()
    with pytest.raises(FileNotFoundError, match="no longer has this segment"):
        _C.fetch_fd(h[7], h[1], h[2] ^ 1, h[6], 5.0)
    fd = _C.fetch_fd(h[7], h[1], h[2], h[6], 5.0)
    assert os.fstat(fd).st_size == h[3]
    os.close(fd)
    _C.release_handle(h)


@pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
@pytest.mark.parametrize("then", ["exit", "sigkill"])
def test_a_message_outliving_its_sender(named, then):
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_workers.allocate_and_send_handle, args=(q, named, then))
    p.start()
    handle = q.get()
    if then == "exit":
        assert q.get() == "bye"
    p.join(60)
    assert p.exitcode == (0 if then == "exit" else -signal.SIGKILL)
    if named or then == "exit":
        # A name outlives its creator while a message names it; an anonymous segment is
        # served by the exit keeper of a sender that exited normally (Note [Exit keeper]).
        block = _C.attach(handle)
        assert bytes(memoryview(block)[:4]) == b"tmx!"
        del block
    else:  # nobody can hand out the fd of a SIGKILLed sender: said so, with the fix
        with pytest.raises(ConnectionRefusedError, match=rf"pid {p.pid}\) has exited"):
            _C.attach(handle)
    q.close()


def test_send_and_receive_fds():
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        _C.send_fds(a.fileno(), b"x", [w])
        data, fds = _C.recv_fds(b.fileno(), 16, 4)
        assert data == b"x" and len(fds) == 1
        os.write(fds[0], b"hello")
        os.close(fds[0])
        assert os.read(r, 5) == b"hello"
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


def test_fds_dropped_at_the_fd_limit_are_an_error_naming_the_limit():
    script = textwrap.dedent(
        """
        import os, resource, socket
        from torch_mp_ext import _C
        a, b = socket.socketpair()
        highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 2, highest + 2))
        spare = []
        while True:
            try:
                spare.append(os.dup(0))
            except OSError:
                break
        os.close(spare.pop())
        os.close(spare.pop())
        r, w = os.pipe()  # takes the two free slots: the table is full again
        _C.send_fds(a.fileno(), b"x", [r])
        try:
            _C.recv_fds(b.fileno(), 16, 1)
        except OSError as e:
            print(type(e).__name__, e.errno, e)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"SharedMemoryError {errno.EMFILE}"), out.stdout
    assert "RLIMIT_NOFILE=" in out.stdout and "ulimit -n" in out.stdout


def test_counter_slots_released_by_real_receivers_and_reclaimed_after_sigkill():
    counters = _C.CounterFile.create(4)
    name = counters.name
    assert os.path.exists("/dev/shm" + name) and name.startswith(f"/torch_{os.getpid()}_")
    slots = [counters.acquire(1) for _ in range(4)]
    assert counters.acquire(1) is None and counters.in_use == 4  # full
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    (s0, g0), (s1, _), *_ = slots
    assert counters.generation(s0) == g0
    p = ctx.Process(target=_workers.counter_decrement, args=(name, counters.segment_id, s0, q))
    p.start()
    assert q.get() == 0
    p.join(60)
    assert counters.value(s0) == 0 and not counters.holder_alive(s0)  # holder gone, count 0
    holder = ctx.Process(target=_workers.counter_hold_forever,
                         args=(name, counters.segment_id, s1, q))
    holder.start()
    assert q.get() == "holding"
    assert counters.holder_alive(s1) and counters.value(s1) == 1
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(60)
    assert counters.value(s1) == 1 and not counters.holder_alive(s1)  # reclaimable
    for slot, _ in slots:
        counters.add(slot, -counters.value(slot))
        counters.recycle(slot)
    assert counters.in_use == 0
    assert counters.unlink() and not os.path.exists("/dev/shm" + name)
    q.close()


def test_reaper_spares_segments_named_by_messages_in_flight():
    script = textwrap.dedent(
        """
        import os, pickle, sys
        from torch_mp_ext import _C
        block = _C.allocate(100, named=True)
        sys.stdout.buffer.write(pickle.dumps(block.share()))
        sys.stdout.flush()
        os.kill(os.getpid(), 9)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120,
                         cwd=ROOT)
    import pickle

    handle = pickle.loads(out.stdout)
    entry = handle[7].lstrip("/")
    assert entry in _C.reap_dead_segments(dry_run=True, include_inflight=True)
    assert entry not in _C.reap_dead_segments(dry_run=True)  # a message still names it
    block = _C.attach(handle)  # ... and can still be received
    del block  # the last reference: gone
    assert not os.path.exists("/dev/shm/" + entry)


def test_the_reaper_takes_a_reused_pid_for_the_dead_holder_it_replaced():
    # A named segment whose creator was SIGKILLed; a holder slot then names this process's
    # pid with another start time (the pid was reused): the segment is still garbage. With
    # this process's true key in that slot, it is not (Note [Holder tables]).
    script = textwrap.dedent(
        """
        import os, sys
        from torch_mp_ext import _C
        block = _C.allocate(100, named=True)
        print(block.name, _C.holder_key(), flush=True)
        os.kill(os.getpid(), 9)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    name, dead_key = out.stdout.split()
    entry = name.lstrip("/")
    me = _C.holder_key()
    impostor = (me & ~0xFFFFFFFF) | ((me + 1) & 0xFFFFFFFF)
    try:
        with open("/dev/shm/" + entry, "r+b") as file, mmap.mmap(file.fileno(), 4096) as m:
            # The creator's key stands twice in the header: owner_key, then its holder slot.
            packed = struct.pack("<Q", int(dead_key))
            slot = m.find(packed, m.find(packed) + 8) + 8  # the next, free, holder slot
            assert slot > 8 and m[slot:slot + 8] == bytes(8)
            m[slot:slot + 8] = struct.pack("<Q", impostor)
            assert entry in _C.reap_dead_segments(dry_run=True)
            m[slot:slot + 8] = struct.pack("<Q", me)
            assert entry not in _C.reap_dead_segments(dry_run=True)
            m[slot:slot + 8] = bytes(8)
        assert entry in _C.reap_dead_segments()
    finally:
        if os.path.exists("/dev/shm/" + entry):
            os.unlink("/dev/shm/" + entry)


def test_process_identity_helpers():
    me = os.getpid()
    start = _C.process_start_time(me)
    assert start > 0 and _C.process_alive(me, start) and not _C.process_alive(me, start + 1)
    assert _C.holder_key() == (me << 32) | (start & 0xFFFFFFFF)
    assert _C.pid_namespace_id() == os.stat("/proc/self/ns/pid").st_ino
    assert _C.fd_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def test_stub_lists_exactly_the_extension():
    with open(os.path.join(ROOT, "torch_mp_ext", "_C.pyi")) as file:
        stub = file.read()
    declared = set(re.findall(r"^(?:def|class) (\w+)", stub, re.M))
    declared |= set(re.findall(r"^(\w+)\s*[:=]", stub, re.M)) - {"Handle"}
    declared = {n for n in declared if not n.startswith("_") or n == "__version__"}
    actual = {n for n in dir(_C) if not n.startswith("_")} | {"__version__"}
    assert declared - {"__version__"} == actual - {"__version__"}
    for name in ("Block", "CounterFile"):
        body = stub.split(f"class {name}")[1].split("\nclass ")[0].split("\ndef ")[0]
        methods = set(re.findall(r"^    def (\w+)", body, re.M)) - {"__buffer__"}
        assert methods == {n for n, _ in inspect.getmembers(getattr(_C, name))
                           if not n.startswith("_")}
