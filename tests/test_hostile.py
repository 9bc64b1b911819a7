"""Hostile input raises Python exceptions, case by case (issue 13; the fuzz suite is
tests/test_fuzz.py).

Cases that crashed the interpreter before the fix (a forged geometry, a ring of capacity 0)
run in the fuzz worker, a child process, so that a regression fails one test instead of
killing pytest.
"""

from __future__ import annotations

import array
import math
import os
import pathlib
import queue
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from test_fuzz import RING_FIELDS, SEG_FIELDS, Worker

import torch_mp_ext
from torch_mp_ext import _C
from torch_mp_ext.errors import CorruptSegmentError


@pytest.fixture
def worker():
    w = Worker()
    yield w
    w.stop()


def field(fields: dict, name: str, value: int, width: int | None = None) -> tuple[int, bytes]:
    offset, size = fields[name]
    width = width or size
    return (offset, (value % (1 << (8 * width))).to_bytes(width, "little"))


# ---- 1. geometry is validated once, with overflow checks, and never re-read -----------------

FORGED = [  # (field, value, the field the error names)
    ("nblocks", 0, "nblocks"), ("nblocks", 2**32 - 1, "nblocks"),
    ("nblocks", 2, "block_size"),  # two blocks do not fit
    ("block_size", 2**64 - 64, "block_size"),  # data_offset + block_size wrapped below size
    ("block_size", 2**63, "block_size"), ("block_size", 100, "block_size"),
    ("data_offset", 0, "data_offset"), ("data_offset", 2**64 - 1, "data_offset"),
    ("masks_offset", 8, "masks_offset"), ("masks_offset", 0, "masks_offset"),
    ("total_size", 1, "total_size"), ("kind", 7, "kind"),
]


def test_forged_geometry_raises_naming_the_field(worker):
    """One worker for every case (a worker takes seconds to start)."""
    for name, value, named in FORGED:
        outcome, kind, message = worker.run({"kind": "segment", "api": "tensor",
                                             "writes": [field(SEG_FIELDS, name, value)]})
        assert (outcome, kind) == ("raised", "CorruptSegmentError"), (name, value, message)
        assert f"header field '{named}'" in message, (name, value, message)
        assert "/dev/shm/torch_fz" in message  # names the segment
    # The check is exact, not merely strict: a faithful copy maps and works.
    assert worker.run({"kind": "segment", "api": "tensor", "writes": []})[0] == "ok"


def test_offsets_near_2_63_do_not_wrap_the_bounds_checks(worker):
    """numpy's buffer check wraps around for an offset near 2^63 (found by the fuzz suite:
    a SIGSEGV); the rebuild checks the extent on Python integers first."""
    for api in ("array", "tensor", "storage"):
        case = {"kind": "segment", "writes": [], "api": api,
                "args": {"offset": 2**63 - 4096}}
        outcome, kind, message = worker.run(case)
        assert (outcome, kind) == ("raised", "ValueError"), (api, message)
        assert "does not fit" in message


def test_a_misaligned_tensor_handle_raises_instead_of_a_sigsegv(worker):
    """The long fuzz run (200,000 examples) found a forged offset that put a complex128
    tensor at an odd address; torch's own kernels then died of SIGSEGV writing it
    (c10::complex<double> is alignas(16): 8 bytes off was fatal too)."""
    for offset, dtype in ((1, torch.complex128), (8, torch.complex128), (1, torch.float64),
                          (2, torch.int32), (1, torch.complex64)):
        case = {"kind": "handle", "writes": [], "api": "tensor", "handle": {},
                "args": {"offset": offset, "nbytes": 16, "dtype": dtype, "stride": (0,)}}
        outcome, kind, message = worker.run(case)
        assert (outcome, kind) == ("raised", "CorruptSegmentError"), (offset, dtype, message)
        assert "aligned" in message
    case = {"kind": "handle", "writes": [], "api": "tensor", "handle": {},
            "args": {"offset": 16, "nbytes": 16, "dtype": torch.complex128, "stride": (0,)}}
    assert worker.run(case)[0] == "ok"


def test_a_misaligned_typed_storage_handle_raises(worker):
    """A TypedStorage crosses as its untyped storage and its dtype: a forged offset must
    not give it an address its dtype's kernels cannot write."""
    for offset, dtype in ((8, torch.complex128), (1, torch.float64), (2, torch.int32)):
        case = {"kind": "handle", "writes": [], "api": "typed_storage", "handle": {},
                "args": {"offset": offset, "nbytes": 32, "dtype": dtype}}
        outcome, kind, message = worker.run(case)
        assert (outcome, kind) == ("raised", "CorruptSegmentError"), (offset, dtype, message)
        assert "aligned" in message
    case = {"kind": "handle", "writes": [], "api": "typed_storage", "handle": {},
            "args": {"offset": 16, "nbytes": 32, "dtype": torch.complex128}}
    assert worker.run(case)[0] == "ok"


def test_a_misaligned_tensor_record_raises():
    """The lean record path (Note [Lean tensor records]) checks alignment too."""
    from torch_mp_ext.sharing import records

    block_tensor = torch_mp_ext.empty(64, dtype=torch.uint8)
    data, _ = _C.share_record(block_tensor.data_ptr() + 4, 32, 0, [4], [1],
                              records._CODES[torch.float64], records.KIND_TENSOR, 0)
    with pytest.raises(CorruptSegmentError, match="not 8-byte aligned"):
        records.rebuild(data)
    del block_tensor


def test_a_free_stack_index_out_of_range_raises_and_the_owner_recovers(worker):
    head = field(SEG_FIELDS, "free_head", (7 << 32) | 5000)
    outcome, kind, message = worker.run({"kind": "owned", "nbytes": 1000, "writes": [head]})
    assert (outcome, kind) == ("raised", "CorruptSegmentError"), message
    assert "free stack" in message and "memfd segment" in message
    # The scribbled segment is retired: the next allocations come from a fresh one.
    assert worker.run({"kind": "owned", "nbytes": 1000, "writes": []})[0] == "ok"


def test_ring_capacity_and_state_are_checked(worker):
    """Capacity 0 was a SIGFPE (pos % capacity) in the receiver; head/tail garbage is caught
    under the lock by a process that had opened the ring before (it keeps its own copy of the
    capacity)."""
    for capacity in [0, 12, 2**32, 2**63]:
        case = {"kind": "ring", "cls": "Queue", "maxsize": 0, "max_bytes": 64,
                "items": [b"a"], "writes": [field(RING_FIELDS, "capacity", capacity)],
                "reopen": True, "ops": ["get"]}
        outcome, kind, message = worker.run(case)
        assert (outcome, kind) == ("raised", "CorruptSegmentError"), (capacity, message)
        assert "'capacity'" in message
    tail = (RING_FIELDS["state"][0] + 8, (2**40).to_bytes(8, "little"))
    case = {"kind": "ring", "cls": "Queue", "maxsize": 0, "max_bytes": 64, "items": [b"a"],
            "writes": [tail], "reopen": False, "ops": ["get"]}
    outcome, kind, message = worker.run(case)
    assert (outcome, kind) == ("raised", "CorruptSegmentError"), message
    assert "head=" in message and "tail=" in message


def _channel(nbuffers: int = 2, nbytes: int = 4096) -> tuple:
    block = _C.allocate(_C.LatestChannel.required_bytes(nbuffers, nbytes))
    return block, _C.LatestChannel(block, nbuffers, nbytes, True)


@pytest.mark.parametrize(("offset", "name"), [(24, "buffer_stride"), (32, "data_offset"),
                                              (40, "total_bytes")])
def test_latest_channel_offsets_are_checked_at_attach(offset, name):
    block, _ = _channel()
    view = memoryview(block).cast("B")
    view[offset:offset + 8] = (2**63 + 4096).to_bytes(8, "little")
    del view
    with pytest.raises(CorruptSegmentError, match=f"'{name}'"):
        _C.LatestChannel(block, 2, 4096, False)


def test_latest_channel_sizes_cannot_wrap():
    with pytest.raises(ValueError, match="larger than"):
        _C.LatestChannel.required_bytes(2, 2**64 - 1)
    block, channel = _channel()
    with pytest.raises(ValueError, match="outside"):  # offset + nbytes wrapped to 0 before
        channel.copy_out(0, [(2**64 - 8, 0, 8)])


# ---- 2. timeouts ---------------------------------------------------------------------------


def _put_later(q, item, delay=0.3):
    t = threading.Thread(target=lambda: (time.sleep(delay), q.put(item)), daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("timeout", [math.inf, 1e300, 2.0**70])
def test_an_infinite_or_huge_timeout_waits_for_ever(timeout):
    q = torch_mp_ext.Queue()
    t = _put_later(q, "late")
    assert q.get(timeout=timeout) == "late"  # did not return at once with Empty
    t.join(5)
    jq = torch_mp_ext.JoinableQueue()
    assert jq.join(timeout=timeout) is True


@pytest.mark.parametrize("make", [torch_mp_ext.Queue, torch_mp_ext.JoinableQueue])
def test_nan_and_bad_types_raise(make):
    q = make()
    with pytest.raises(ValueError, match="'timeout' must be a non-negative number"):
        q.get(timeout=math.nan)
    with pytest.raises(ValueError, match="'timeout' must be a non-negative number"):
        q.put(1, timeout=math.nan)
    with pytest.raises(TypeError, match="'timeout' must be a number or None"):
        q.get(timeout="1")
    with pytest.raises(queue.Empty):  # negative: do not wait, as multiprocessing.Queue
        q.get(timeout=-1)
    with pytest.raises(TypeError, match="'timeout' must be a number or None"):
        q.get(timeout=True)  # a bool is not a timeout, though it is an int
    with pytest.raises(ValueError, match="'timeout' must be a non-negative number"):
        q.put_many([1], timeout=math.nan)
    with pytest.raises(ValueError, match="'timeout' must be a non-negative number"):
        q.get_many(1, timeout=math.nan)
    q.put(1, timeout=5)  # int timeouts take the fast path
    assert q.get(timeout=5) == 1
    with pytest.raises(queue.Empty):
        q.get(timeout=0)
    if make is torch_mp_ext.JoinableQueue:
        with pytest.raises(ValueError, match="'timeout' must be a non-negative number"):
            q.join(timeout=-1)


def test_channel_and_task_timeouts_are_checked():
    sd = {"w": torch.zeros(4)}
    ch = torch_mp_ext.StateDictChannel(sd)
    try:
        with pytest.raises(ValueError, match="'timeout' must be a non-negative number"):
            ch.wait(timeout=math.nan)
        with pytest.raises(ValueError, match="'timeout' must be a non-negative number"):
            ch.read(timeout=-1.0)
        with pytest.raises(TimeoutError):
            ch.wait(timeout=0.05)
        ch.publish(sd, timeout=math.inf)
        assert ch.wait(timeout=math.inf) == 0
    finally:
        ch.close()


# ---- 3. the fd server's answer and the received fd are checked -----------------------------


class FakeFdServer:
    """Binds an abstract address the way a hostile local process would, and answers every
    request with ``fd``."""

    def __init__(self, fd: int) -> None:
        self.address = f"@tmx-fake-{os.getpid()}-{time.monotonic_ns()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + self.address[1:])
        self.sock.listen(4)
        self.fd = fd
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(16)
                socket.send_fds(conn, [struct.pack("<i", 0)], [self.fd])
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


def _handle(server: FakeFdServer, owner_pid: int, size: int = 8192) -> tuple:
    return (False, 12345, 678, size, 0, 1, owner_pid, server.address)


def test_an_fd_server_that_is_not_the_owner_is_refused():
    fd = os.memfd_create("tmx_fake")
    server = FakeFdServer(fd)
    try:
        with pytest.raises(PermissionError, match="not the segment's owner"):
            _C.attach(_handle(server, owner_pid=1), 5.0)
    finally:
        server.close()
        os.close(fd)


def test_a_received_fd_that_is_not_shared_memory_is_refused():
    read_end, write_end = os.pipe()
    server = FakeFdServer(read_end)
    try:
        with pytest.raises(CorruptSegmentError, match="not a shared-memory file"):
            _C.attach(_handle(server, owner_pid=os.getpid()), 5.0)
    finally:
        server.close()
        os.close(read_end)
        os.close(write_end)


@pytest.mark.parametrize(("size", "uid", "match"), [
    (8192, None, "bad magic"), (100, None, "truncated"), (16384, None, "handle says"),
    (8192, 65534, "belongs to uid 65534"),
])
def test_a_received_memfd_is_checked_before_it_is_mapped(size, uid, match):
    fd = os.memfd_create("tmx_fake")
    os.ftruncate(fd, size)
    if uid is not None:
        if os.geteuid() != 0:
            pytest.skip("changing a file's owner needs root")
        os.fchown(fd, uid, uid)
    server = FakeFdServer(fd)
    try:
        with pytest.raises(CorruptSegmentError, match=match):
            _C.attach(_handle(server, owner_pid=os.getpid()), 5.0)
    finally:
        server.close()
        os.close(fd)


def test_a_named_segment_name_is_checked():
    with pytest.raises(ValueError, match="not a shared-memory segment name"):
        _C.attach((True, 1, 0, 8192, 0, 0, os.getpid(), "/../../etc/passwd"), 1.0)


# ---- 4. bad dtypes, shapes and sizes at the public functions -------------------------------


@pytest.mark.parametrize("dtype", [object, "O", [("a", "O")], np.dtype("O")])
def test_object_arrays_cannot_be_born_shared(dtype):
    with pytest.raises(ValueError, match="dtype"):
        torch_mp_ext.empty_array((3,), dtype=dtype)
    with pytest.raises(ValueError, match="dtype"):
        torch_mp_ext.zeros_array(3, dtype=dtype)


@pytest.mark.parametrize("shape", [(-1,), (3, -2), (2**40, 2**40), (3, 6148914691236517206),
                                   (1.5,), ("3",), (None,), (True,)])
def test_bad_shapes_raise_naming_the_argument(shape):
    with pytest.raises((ValueError, TypeError), match="shape|size"):
        torch_mp_ext.empty_array(shape, dtype=np.uint8)
    with pytest.raises((ValueError, TypeError), match="shape|size"):
        torch_mp_ext.empty(*shape, dtype=torch.uint8)


def test_bad_dtypes_raise_naming_the_argument():
    with pytest.raises(TypeError, match="dtype"):
        torch_mp_ext.empty(3, dtype=np.float32)
    with pytest.raises(TypeError, match="dtype"):
        torch_mp_ext.empty_array(3, dtype="not-a-dtype")
    with pytest.raises(TypeError, match="tensor"):
        torch_mp_ext.empty_like(array.array("f", [1.0]))


@pytest.mark.parametrize(("kwargs", "exc"), [
    ({"maxsize": "3"}, TypeError), ({"maxsize": 1.5}, TypeError), ({"maxsize": None}, TypeError),
    ({"max_bytes": 8}, ValueError), ({"max_bytes": 2**40}, ValueError),
    ({"max_bytes": "big"}, ValueError),
])
def test_bad_queue_arguments_raise(kwargs, exc):
    with pytest.raises(exc, match="maxsize|max_bytes"):
        torch_mp_ext.Queue(**kwargs)


# ---- 5. resource exhaustion names the limit, and the process recovers ----------------------

_FD_LIMIT = """
import resource, torch, torch_mp_ext as mp
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
held = []
try:
    for _ in range(200):  # > SMALL_MAX: one segment, so one fd, each
        held.append(mp.empty(300000, dtype=torch.uint8))
    raise SystemExit("no error at 200 segments under RLIMIT_NOFILE=64")
except OSError as exc:
    assert isinstance(exc, mp.errors.SharedMemoryError), repr(exc)
    assert "RLIMIT_NOFILE=64" in str(exc) and "ulimit -n" in str(exc), str(exc)
held.clear()  # the freed segments' fds are released when the next allocation needs them
t = mp.empty(300000, dtype=torch.uint8)
q = mp.Queue()
q.put(t)
assert q.get().shape == (300000,)
q.close()
print("recovered")
"""

_AS_LIMIT = """
import resource, torch, torch_mp_ext as mp
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), vm + (512 << 20)))
held = []
try:
    for _ in range(100):
        held.append(mp.empty(64 << 20, dtype=torch.uint8))
    raise SystemExit("no error at 6.4 GB under RLIMIT_AS = current + 512 MiB")
except OSError as exc:
    assert isinstance(exc, mp.errors.SharedMemoryError), repr(exc)
    assert "RLIMIT_AS" in str(exc), str(exc)
held.clear()
t = mp.empty(64 << 20, dtype=torch.uint8)
q = mp.Queue()
q.put(t)
assert q.get().shape == (64 << 20,)
q.close()
print("recovered")
"""


@pytest.mark.parametrize("script", [_FD_LIMIT, _AS_LIMIT], ids=["RLIMIT_NOFILE", "RLIMIT_AS"])
def test_resource_exhaustion_names_the_limit_and_recovers(script):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TORCH_MP_EXT_EXIT_LINGER_S="0")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "recovered" in done.stdout, done.stderr[-3000:]


def test_a_forged_channel_layout_is_refused():
    """read_into copies each entry's nbytes into the caller's tensor: a pickle that says more
    bytes than the tensor has would write past it."""
    import dataclasses
    import pickle

    from torch_mp_ext.exchange import channel as channel_mod

    ch = torch_mp_ext.StateDictChannel({"w": torch.zeros(4)})
    try:
        func, args = ch.__reduce__()
        entry = args[3][0]
        for forged in (dataclasses.replace(entry, nbytes=entry.nbytes + 4096),
                       dataclasses.replace(entry, offset=-8),
                       dataclasses.replace(entry, offset=args[2]),
                       dataclasses.replace(entry, shape=(2**62,))):
            bad = (args[0], args[1], args[2], [forged], args[4])
            with pytest.raises(CorruptSegmentError, match="forged"):
                func(*bad)
            _C.release_handle(args[0])  # the refused rebuild left the handle's reference
            args = ch.__reduce__()[1]
        good = pickle.loads(pickle.dumps(ch))
        good.close()
        _C.release_handle(args[0])
        assert channel_mod._check_entries([entry], args[2]) is None
    finally:
        ch.close()


@pytest.mark.parametrize(("handle", "name"), [
    ((True, "x", 0, 0, 0, 0, 0, ""), "segment_id"), ((True, 1, 0, 0, -1, 0, 0, ""), "index"),
    ((True, 1, 0, 2**64, 0, 0, 0, ""), "size"), ((True, 1, 0, 0, 0, 0, 2**31, ""), "owner_pid"),
    ((True, 1, 0, 0, 0, 0, 0, None), "location"),
])
def test_a_handle_field_of_the_wrong_type_is_a_type_error_naming_it(handle, name):
    with pytest.raises(TypeError, match=f"field '{name}'"):
        _C.attach(handle)


# ---- 6. a stopped peer holding the ring's lock does not freeze the interpreter -------------


def _lock_ring_and_stop(q, ready) -> None:
    import ctypes
    import signal

    address = q._ring.block.address + RING_FIELDS["mutex"][0]
    assert ctypes.CDLL(None).pthread_mutex_lock(ctypes.c_void_p(address)) == 0
    ready.set()
    os.kill(os.getpid(), signal.SIGSTOP)


@pytest.mark.slow  # a peer stopped with the lock held, waited on for seconds: 4 s
def test_a_stopped_peer_holding_the_lock_does_not_freeze_the_interpreter():
    import multiprocessing
    import signal

    q = torch_mp_ext.Queue()
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    peer = ctx.Process(target=_lock_ring_and_stop, args=(q, ready))
    peer.start()
    try:
        assert ready.wait(30)
        stat = f"/proc/{peer.pid}/stat"
        while pathlib.Path(stat).read_text().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)
        ticks = []
        stop = threading.Event()
        ticker = threading.Thread(target=lambda: [ticks.append(1) or time.sleep(0.01)
                                                  for _ in iter(stop.is_set, True)])
        ticker.start()

        def interrupt(signum, frame):
            raise KeyboardInterrupt  # what Ctrl-C does

        # The suite's timeout (pytest-timeout) runs on this same timer: take it back after.
        armed, armed_at = signal.getitimer(signal.ITIMER_REAL)[0], time.monotonic()
        old = signal.signal(signal.SIGALRM, interrupt)
        try:
            for read in (q.qsize, lambda: q._ring.holders, q._ring.holder_table):
                before = len(ticks)
                signal.setitimer(signal.ITIMER_REAL, 0.6)
                with pytest.raises(KeyboardInterrupt):
                    read()
                assert len(ticks) > before + 5, "the GIL was held while waiting for the lock"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            if armed:
                left = armed - (time.monotonic() - armed_at)
                signal.setitimer(signal.ITIMER_REAL, max(left, 0.001))
            stop.set()
            ticker.join(10)
    finally:
        peer.kill()
        peer.join(30)
    assert q.qsize() == 0  # the dead owner's lock is repaired
    q.close()


def test_a_forged_array_queue_layout_is_refused():
    """An ArrayQueue's arrays view nbytes at each block's address: a pickle that says more
    bytes than a block has would read and write past it."""
    from torch_mp_ext.queues import array_queue

    aq = torch_mp_ext.ArrayQueue(np.zeros(4), maxsize=2)
    func, args = aq.__reduce__()
    meta = list(args[0])
    meta[4] = 1 << 20  # nbytes beyond the blocks
    meta[0] = (1 << 17,)
    with pytest.raises(CorruptSegmentError, match="forged"):
        func(tuple(meta), *args[1:])
    good = func(*aq.__reduce__()[1])
    assert good._shape == (4,)
    with pytest.raises(ValueError, match="maxsize"):
        torch_mp_ext.ArrayQueue(np.zeros(4), maxsize=array_queue.MAX_ARRAYS + 1)
    del good, aq


# ---- the robust mutex's bytes (Note [Mutex bytes from a peer], Note [A lock nobody holds]) ---

_MUTEX = """
import struct, sys, time, torch_mp_ext as mp
from torch_mp_ext import _C
from torch_mp_ext.errors import CorruptSegmentError, PeerDiedError
at = dict((n, o) for n, o, _ in _C.Ring.layout())["mutex"]
word, value = int(sys.argv[1]), int(sys.argv[2])
q = mp.Queue()
q.put(1)
buf = memoryview(q._ring.block).cast("B")
buf[at + 4 * word:at + 4 * word + 4] = struct.pack("<I", value)
start = time.monotonic()
for call in (q.get, lambda: q.put(2), q.qsize, q.close):  # untimed: timeout=None
    try:
        call()
        raise SystemExit(f"{call} returned")
    except (CorruptSegmentError, PeerDiedError) as exc:
        assert "corrupt" in str(exc) or "inconsistent" in str(exc), str(exc)
assert time.monotonic() - start < 5, time.monotonic() - start
print("raised")
"""


# Each case is a fresh interpreter (2-3 s on 2 CPUs): the fast tier takes one garbage type
# word and each kind of owner; the slow tier the other type words and the waiters bit.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(("word", "value"), [
    pytest.param(4, 0, marks=_SLOW),  # type: normal
    pytest.param(4, 1, marks=_SLOW),  # ... recursive
    pytest.param(4, 32 | 128, marks=_SLOW),  # ... PI
    (4, 0xFFFFFFFF),  # ... garbage
    (0, 0x3FFFFFF0),  # an owner thread that cannot exist
    pytest.param(0, 0x80000000 | 0x3FFFFFF0, marks=_SLOW),  # ... with the waiters bit
    (0, -1),  # this very thread (filled in below)
    (0, 1),  # a live process (init) that holds no queue
])
def test_garbage_in_the_queue_mutex_raises_instead_of_waiting_for_ever(word, value):
    """Every untimed call (get, put, qsize, close) answers within seconds."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TORCH_MP_EXT_EXIT_LINGER_S="0")
    script = _MUTEX if value != -1 else _MUTEX.replace(
        "value = int(sys.argv[1]), int(sys.argv[2])",
        "value = int(sys.argv[1]), __import__('threading').get_native_id()")
    done = subprocess.run([sys.executable, "-c", script, str(word), str(value)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "raised" in done.stdout, done.stderr[-3000:]


# ---- a named segment truncated under a live mapping (Note [Truncated under us]) -------------

_TRUNCATED = """
import os, pickle, subprocess, sys
import torch
import torch_mp_ext as mp
from torch_mp_ext import _C, reductions
from torch_mp_ext.errors import CorruptSegmentError

mp.set_sharing_strategy("file_system")
size = int(sys.argv[1])
t = mp.empty(300000, dtype=torch.uint8)
t.fill_(1)
keep = mp.empty(1000, dtype=torch.uint8)  # a pooled block, in another segment
handle = reductions._share(t.untyped_storage())[0]  # one reference in flight
path = "/dev/shm" + handle[7]
print(path, flush=True)
# Another process shrinks the file while this one maps it.
subprocess.run([sys.executable, "-c", f"import os; os.truncate({path!r}, {size})"], check=True)
assert os.stat(path).st_size == size
outcomes = []

def expect(what, call, must_raise):
    try:
        call()
        outcomes.append((what, "ok"))
        assert not must_raise, f"{what}: no error"
    except CorruptSegmentError as exc:
        assert "truncated" in str(exc) and "file_descriptor" in str(exc), str(exc)
        outcomes.append((what, "raised"))

q = mp.Queue()
expect("put", lambda: q.put(t), must_raise=size < 4096)
# A process that maps it now is refused at attach: fstat says it shrank.
rebuild = pickle.dumps((reductions.rebuild_cpu_tensor,
                        (handle, 0, 300000, torch.uint8, (300000,), (1,), 0, False, None)))
code = ("import pickle, sys\\nfrom torch_mp_ext.errors import CorruptSegmentError\\n"
        "f, a = pickle.loads(sys.stdin.buffer.read())\\n"
        "try:\\n    f(*a)\\nexcept CorruptSegmentError as e:\\n"
        "    assert 'truncated' in str(e) or 'bytes but its handle says' in str(e), str(e)\\n"
        "    print('refused')\\n")
fresh = subprocess.run([sys.executable, "-c", code], input=rebuild, capture_output=True,
                       env=dict(os.environ, TORCH_MP_EXT_EXIT_LINGER_S="0"), timeout=120)
assert fresh.returncode == 0 and b"refused" in fresh.stdout, fresh.stderr[-2000:]
expect("empty_cache", mp.empty_cache, must_raise=False)
expect("release_handle", lambda: _C.release_handle(handle), must_raise=False)
del t  # the block's refcount lives in a page that is gone: no SIGBUS either
expect("reclaim", _C.reclaim_dead_holders, must_raise=False)
expect("reap", lambda: _C.reap_dead_segments(), must_raise=False)
if outcomes[0][1] == "ok":  # t's handle is queued: mapping it again is refused (or it was
    expect("get", lambda: q.get(timeout=30), must_raise=False)  # still mapped: not read)
q.put(keep)  # the other segments still work
assert q.get(timeout=30).sum() == keep.sum()
q.close()
print("survived", outcomes, _C.sigbus_pages_lost())
"""


# Each size is a fresh interpreter (2-3 s): 100 (the header page half zeroed) is slow tier.
@pytest.mark.parametrize("size", [0, pytest.param(100, marks=pytest.mark.slow), 8192])
def test_a_named_segment_truncated_by_a_peer_raises_instead_of_sigbus(size):
    """size 0: every page is gone (the header's accesses fault: a zero page and an error);
    100: the header page stays but is zeroed past byte 100; 8192: the header and slot table
    stay, the data goes. In every case the process lives and its API raises or works."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TORCH_MP_EXT_EXIT_LINGER_S="0")
    done = subprocess.run([sys.executable, "-c", _TRUNCATED, str(size)], env=env,
                          capture_output=True, text=True, timeout=120)
    path = done.stdout.split("\n", 1)[0]
    if path.startswith("/dev/shm/torch_"):
        pathlib.Path(path).unlink(missing_ok=True)  # its flags were truncated away with it
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode,
                                                                 done.stderr[-3000:])
    if size < 4096:
        assert "('put', 'raised')" in done.stdout, done.stdout


# ---- a sender exactly at its fd limit (Note [A server at its fd limit]) ----------------------


def _sender_at_fd_limit(q, go_on, done):
    import resource

    torch_mp_ext.set_sharing_strategy("file_descriptor")
    warm = torch_mp_ext.empty(10)
    warm.share_memory_()
    _C.fd_server_address()  # the server runs before the limit is lowered
    t = torch_mp_ext.empty(300000, dtype=torch.uint8)  # its own segment: one fd kept
    top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    limit = top + 8
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(
        resource.RLIMIT_NOFILE)[1]))
    fill = []
    try:
        while True:
            fill.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass  # EMFILE: every fd below the limit is open
    q.put(limit)
    q.put(t)
    go_on.wait(60)
    for fd in fill:
        os.close(fd)
    q.put(t)  # below the limit again: it is received
    done.wait(60)


def test_a_sender_at_its_fd_limit_still_passes_its_segments():
    """Note [A server at its fd limit]: the answer passes the segment's own fd, so a sender
    with every fd below its limit open still hands its tensors over (issue 35 D3: it
    answered EMFILE, and the handles in flight kept its blocks live for ever)."""
    import multiprocessing

    q = torch_mp_ext.Queue()
    ctx = multiprocessing.get_context("fork")
    go_on, done = ctx.Event(), ctx.Event()
    sender = ctx.Process(target=_sender_at_fd_limit, args=(q, go_on, done))
    sender.start()
    try:
        q.get(timeout=60)  # the sender's limit
        assert q.get(timeout=60).shape == (300000,)  # at the limit
        go_on.set()
        assert q.get(timeout=60).shape == (300000,)  # and below it again
    finally:
        go_on.set()
        done.set()
        sender.join(60)
        if sender.is_alive():
            sender.kill()
            sender.join(30)
    q.close()


# ---- vm.max_map_count exhausted --------------------------------------------------------------

_MAP_COUNT = """
import ctypes, mmap, os, torch, torch_mp_ext as mp
limit = int(open("/proc/sys/vm/max_map_count").read())
if limit > 300000:
    print("skip: vm.max_map_count is", limit)
    raise SystemExit(0)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
warm = mp.empty(300000, dtype=torch.uint8)  # the allocator's own structures exist already
del warm
mp.empty_cache()  # and its segment is gone: the next one needs a new mapping
fd = os.memfd_create("maps")
os.ftruncate(fd, mmap.PAGESIZE)
maps = []
while True:  # one page of one file at offset 0, again and again: each is its own mapping
    p = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if p in (None, ctypes.c_void_p(-1).value):
        break
    maps.append(p)
try:
    mp.empty(300000, dtype=torch.uint8)
    raise SystemExit("no error with every mapping used")
except OSError as exc:
    message = str(exc)
    assert isinstance(exc, mp.errors.SharedMemoryError), repr(exc)
    assert "vm.max_map_count" in message and f"{limit}" in message, message
    assert "sysctl -w vm.max_map_count=" in message, message
for p in maps:
    libc.munmap(p, mmap.PAGESIZE)
t = mp.empty(300000, dtype=torch.uint8)  # recovered
t.fill_(1)
print("recovered", len(maps))
"""


def test_an_exhausted_map_count_names_vm_max_map_count():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TORCH_MP_EXT_EXIT_LINGER_S="0")
    done = subprocess.run([sys.executable, "-c", _MAP_COUNT], env=env, capture_output=True,
                          text=True, timeout=60)
    if done.stdout.startswith("skip"):
        pytest.skip(done.stdout)
    assert done.returncode == 0 and "recovered" in done.stdout, done.stderr[-3000:]
