"""Hostile shared memory and handles never crash the interpreter (issue 13).

A crashed, buggy or compromised peer can write anything into the shared segments and send any
bytes as a handle. Hypothesis generates such inputs; a child process (tests/_fuzz_worker.py)
applies them and calls the public API. It must answer every case with a Python exception or a
result, never die by a signal (SIGSEGV, SIGBUS, SIGFPE, abort) and never hang.

Each kind of case is fuzzed twice. The fast tier runs ``FAST_EXAMPLES`` examples per test,
derandomized: the same examples every run, so a failure there is a regression, never a
new random find. The slow tier (``--slow``) runs ``TMX_FUZZ_EXAMPLES`` random examples per
test (default 2,000: 10,000 in all); ``TMX_FUZZ_EXAMPLES=40000`` (200,000 in all) is the
long, nightly-style run.

Note [What the fuzzer leaves alone]
Every byte of a ring is fair game, its robust pthread mutex included (Note [Mutex bytes from
a peer] in csrc/sync/robust_mutex.h): a garbage type word must raise, and a garbage owner
must raise or time out, never wait for ever (Note [A lock nobody holds] in
csrc/queue/ring.cpp). What a peer writes *while* this process holds the mutex (a race with a
hostile writer) is out of the fuzzer's reach. Named segments are truncated before they are
mapped here; a truncation under a live mapping is tests/test_hostile.py's
(Note [Truncated under us] in csrc/shm/sigbus.h).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_mp_ext import _C

FAST_EXAMPLES = 60
EXAMPLES = int(os.environ.get("TMX_FUZZ_EXAMPLES", "2000"))
CASE_TIMEOUT_S = 30.0  # a case may wait out garbage owners (Note [A lock nobody holds])
ROOT = Path(__file__).resolve().parent.parent

SEG_FIELDS = {name: (offset, size) for name, offset, size in _C.segment_layout()}
RING_FIELDS = {name: (offset, size) for name, offset, size in _C.Ring.layout()}
SLOTS_AT, SLOT_BYTES = SEG_FIELDS["slots"]
SLOT_FIELDS = [(0, 8), (8, 4), (12, 4), (16, 8), (24, 8)]  # refcount next generation holder tag

_SETTINGS: dict[str, Any] = dict(
    deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture])
SHORT_RUN = settings(max_examples=FAST_EXAMPLES, derandomize=True, **_SETTINGS)
LONG_RUN = settings(max_examples=EXAMPLES, derandomize=False, **_SETTINGS)


class Worker:
    """The child that runs cases; restarted after it dies so that shrinking can go on."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        path = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
        # A lock owner that cannot be judged is waited out for 0.1 s, not 2 (Note [A lock
        # nobody holds]): the same paths, in less time. Named blocks are segments of their
        # own (Note [Pooled names]: 0 turns pooling off), so a template is one 4 KB block's
        # segment, not a 2 MB slab, and a worker killed by a case leaves no cached name.
        env = dict(os.environ, PYTHONPATH=path, TORCH_MP_EXT_EXIT_LINGER_S="0",
                   TORCH_MP_EXT_LOCK_DOUBT_S="0.1", TORCH_MP_EXT_NAMED_CACHE_S="0")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "_fuzz_worker.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert self._read(1, 120.0) == b"R", "the fuzz worker did not start"

    def _read(self, n: int, timeout: float) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        out = b""
        while len(out) < n:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise EOFError
            out += chunk
        return out

    def run(self, case: dict) -> tuple[str, str, str]:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None
        data = pickle.dumps(case)
        self.proc.stdin.write(struct.pack("<I", len(data)) + data)
        self.proc.stdin.flush()
        try:
            size = struct.unpack("<I", self._read(4, CASE_TIMEOUT_S))[0]
            return pickle.loads(self._read(size, CASE_TIMEOUT_S))
        except TimeoutError:
            pid = self.proc.pid
            self.proc.kill()  # a hung worker does not read its stdin's EOF
            self.stop()
            pytest.fail(f"the fuzz worker (pid {pid}) hung for {CASE_TIMEOUT_S} s on {case!r}")
        except EOFError:
            pid, code = self.proc.pid, self.proc.wait(timeout=30)
            self.proc = None
            self._clean(pid)
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            pytest.fail(f"the fuzz worker died ({how}) on {case!r}")

    def _clean(self, pid: int) -> None:
        """Unlinks the names the worker ``pid`` left (never another run's: a concurrent
        suite's fuzz workers use the same prefix with their own pids)."""
        prefix = f"torch_fz{pid}_"
        for entry in os.listdir("/dev/shm"):
            if entry.startswith(prefix):
                try:
                    os.unlink("/dev/shm/" + entry)
                except FileNotFoundError:
                    pass

    def stop(self) -> None:
        if self.proc is None:
            return
        pid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.proc.stdout.close()  # type: ignore[union-attr]
        self.proc = None
        self._clean(pid)


@pytest.fixture
def worker() -> Any:
    w = Worker()
    yield w
    w.stop()


def check(worker: Worker, case: dict) -> None:
    outcome, kind, message = worker.run(case)
    assert outcome != "unexpected", f"{kind}: {message} on {case!r}"


# ---- strategies ---------------------------------------------------------------------------

INTERESTING = st.sampled_from(
    [0, 1, 2, 7, 8, 15, 16, 63, 64, 4095, 4096, 65536, 2**31 - 1, 2**31, 2**32 - 2,
     2**32 - 1, 2**32, 2**48, 2**63 - 1, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1)


def field_writes(fields: dict[str, tuple[int, int]], base: int = 0) -> st.SearchStrategy:
    def one(item: tuple[str, tuple[int, int]]) -> st.SearchStrategy:
        offset, size = item[1]
        width = min(size, 8)
        return st.tuples(st.integers(0, max(size // width - 1, 0)), INTERESTING).map(
            lambda iv: (base + offset + iv[0] * width,
                        (iv[1] % (1 << (8 * width))).to_bytes(width, "little")))
    return st.sampled_from(sorted(fields.items())).flatmap(one)


def slot_writes(nslots: int) -> st.SearchStrategy:
    return st.tuples(st.integers(0, nslots - 1), st.sampled_from(SLOT_FIELDS), INTERESTING).map(
        lambda t: (SLOTS_AT + t[0] * SLOT_BYTES + t[1][0],
                   (t[2] % (1 << (8 * t[1][1]))).to_bytes(t[1][1], "little")))


RAW_WRITES = st.tuples(st.integers(0, 16384), st.binary(min_size=1, max_size=16))
HEADER_FIELDS = {k: v for k, v in SEG_FIELDS.items() if k not in ("slots", "name")}
SEGMENT_WRITES = st.lists(
    field_writes(HEADER_FIELDS) | slot_writes(1) | RAW_WRITES, min_size=0, max_size=4)

HANDLE_OVERRIDES = st.dictionaries(
    st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7]),
    st.one_of(st.booleans(), INTERESTING, st.integers(-2**63, 2**64 + 5),
              st.sampled_from(["", "/", "//", "/a/b", "@", "@tmx-none", "/torch_missing",
                               "x" * 200, "/\0", "/../../etc/passwd", "@" + "y" * 120]),
              st.text(max_size=40), st.none(), st.binary(max_size=8)),
    max_size=3)

SIZES = st.lists(st.integers(-2, 2**62), min_size=0, max_size=3).map(tuple)
REBUILD_ARGS = st.fixed_dictionaries({}, optional={
    "offset": st.integers(-1, 2**63), "nbytes": st.integers(-1, 2**63) | st.integers(0, 8192),
    "size": SIZES, "stride": SIZES, "storage_offset": st.integers(-1, 2**62),
    "dtype": st.sampled_from([torch.uint8, torch.float64, torch.complex128, torch.bool]),
    "np_dtype": st.sampled_from(["uint8", "float64", "V3", "O", "U2", "m8"]),
    "strides": st.none() | SIZES,
})

SEGMENT_CASES = st.fixed_dictionaries({
    "kind": st.just("segment"),
    "writes": SEGMENT_WRITES,
    "api": st.sampled_from(["tensor", "storage", "typed_storage", "array", "pickle",
                            "release"]),
    "reclaim": st.booleans(),
}, optional={"truncate": st.integers(0, 2**20), "handle": HANDLE_OVERRIDES,
             "args": REBUILD_ARGS})

HANDLE_CASES = st.fixed_dictionaries({
    "kind": st.just("handle"), "writes": st.just([]),
    "api": st.sampled_from(["tensor", "typed_storage", "array", "release", "pickle"]),
    "handle": HANDLE_OVERRIDES.filter(bool), "args": REBUILD_ARGS,
})

OWNED_FIELDS = {k: v for k, v in SEG_FIELDS.items()
                if k in ("free_head", "live_blocks", "inflight", "flags", "holders", "nblocks",
                         "block_size", "data_offset", "masks_offset", "total_size", "kind")}
OWNED_CASES = st.fixed_dictionaries({
    "kind": st.just("owned"),
    "nbytes": st.sampled_from([64, 1000, 5000, 70000]),
    "writes": st.lists(field_writes(OWNED_FIELDS) | slot_writes(4), min_size=1, max_size=4),
    "reclaim": st.booleans(),
})

MUTEX_AT, MUTEX_BYTES = RING_FIELDS["mutex"]
# glibc x86-64/aarch64 words: lock (owner tid | OWNER_DIED 1<<30 | WAITERS 1<<31), count,
# owner, nusers, kind (16 robust | 128 pshared; 1-3 recursive/errorcheck/adaptive, 32 PI,
# 64 PP, 256/512 elision), spins/elision, list links.
MUTEX_VALUES = st.sampled_from(
    [0, 1, 2, 3, 16, 17, 18, 19, 32, 48, 64, 80, 128, 129, 144, 145, 146, 147, 160, 176, 192,
     208, 400, 656, 2**22, 2**30 - 1, 2**30, 2**30 + 1, 2**31, 2**31 + 1, 2**31 + 2**30,
     2**32 - 1, 0x7ffffffe, 0x7fffffff]) | st.integers(0, 2**32 - 1)
MUTEX_WRITES = st.tuples(st.integers(0, MUTEX_BYTES // 4 - 1), MUTEX_VALUES).map(
    lambda iv: (MUTEX_AT + 4 * iv[0], iv[1].to_bytes(4, "little")))
RING_CASES = st.fixed_dictionaries({
    "kind": st.just("ring"),
    "cls": st.sampled_from(["Queue", "JoinableQueue", "SimpleQueue"]),
    "maxsize": st.integers(0, 4),
    "max_bytes": st.sampled_from([16, 64, 256, 4096]),
    "items": st.lists(st.sampled_from([b"", b"abc", 7, "x" * 100]), max_size=3),
    "writes": st.lists(field_writes(RING_FIELDS) | MUTEX_WRITES | RAW_WRITES, min_size=1,
                       max_size=4),
    "reopen": st.booleans(),
    "ops": st.lists(st.sampled_from(["get", "get_nowait", "put", "put_many", "get_many",
                                     "qsize", "empty", "task_done", "join", "doorbell",
                                     "close"]),
                    min_size=1, max_size=5),
    "self_owner": st.sampled_from([None, None, None, None, "thread", "child"]),
})


VALUE_NAMES = st.sampled_from([
    "none", "true", "zero", "one", "neg", "big", "huge", "nan", "inf", "float", "str", "bytes",
    "list", "neg_list", "huge_list", "wrap_list", "tuple", "empty_tuple", "object", "dtype_obj",
    "np_obj", "np_f4", "torch_f4", "torch_c", "tensor", "meta", "noncontig", "array",
    "obj_array", "struct", "dict", "bad_dict", "module", "zero_d"])
CALL_CASES = st.fixed_dictionaries({
    "kind": st.just("call"),
    "func": st.sampled_from(["empty", "zeros", "empty_like", "empty_array", "zeros_array",
                             "share_", "is_shared", "Queue", "JoinableQueue", "ArrayQueue",
                             "StateDictChannel"]),
    "args": st.lists(VALUE_NAMES, max_size=3),
    "kwargs": st.dictionaries(st.sampled_from(["dtype", "maxsize", "max_bytes", "buffers",
                                               "requires_grad", "shape"]),
                              VALUE_NAMES, max_size=2),
})


# ---- the tests ----------------------------------------------------------------------------


def short_and_long(cases: st.SearchStrategy) -> tuple[Any, Any]:
    """The fast tier's short derandomized run of ``cases`` and the slow tier's long one."""

    def run(worker: Worker, case: dict) -> None:
        check(worker, case)

    return (SHORT_RUN(given(case=cases)(run)),
            pytest.mark.slow(LONG_RUN(given(case=cases)(run))))


test_fuzz_received_segments, test_fuzz_received_segments_long = short_and_long(SEGMENT_CASES)
test_fuzz_forged_handles, test_fuzz_forged_handles_long = short_and_long(HANDLE_CASES)
test_fuzz_owned_segments, test_fuzz_owned_segments_long = short_and_long(OWNED_CASES)
test_fuzz_rings, test_fuzz_rings_long = short_and_long(RING_CASES)
test_fuzz_public_arguments, test_fuzz_public_arguments_long = short_and_long(CALL_CASES)


@pytest.mark.slow  # waits out a hang on purpose: 4 s
def test_harness_reports_a_crash_and_a_hang(worker: Worker, monkeypatch: Any) -> None:
    """The suite would see a crash: a worker killed by a signal, or hung, fails the test."""
    with pytest.raises(pytest.fail.Exception, match="SIGSEGV"):
        worker.run({"kind": "crash", "signal": signal.SIGSEGV})
    monkeypatch.setattr(sys.modules[__name__], "CASE_TIMEOUT_S", 1.0)
    with pytest.raises(pytest.fail.Exception, match="hung"):
        worker.run({"kind": "hang"})
    assert worker.run({"kind": "handle", "writes": [], "api": "release",
                       "handle": {4: 5}})[0] in ("ok", "raised")
