"""Cases of tests/test_limits.py, each run as ``python tests/_limits_workers.py CASE`` in a
fresh interpreter (inside a private, full tmpfs /dev/shm or under an rlimit set here first).
A case asserts what it checks and prints ``ok``; any signal shows as a negative returncode."""

from __future__ import annotations

import errno
import os
import resource
import signal
import sys
import time

TIMEOUT = 60


def reads_one(q, out):
    """Child target: the item put for it, or the error, goes back on ``out``."""
    try:
        out.put(("ok", q.get(timeout=TIMEOUT)))
    except Exception as exc:  # noqa: BLE001 (reported to the parent, which fails the test)
        out.put(("err", repr(exc)))


def _hand_off(mp, method: str) -> None:
    """A tensor put by this process arrives whole in a child of ``method``."""
    import torch

    ctx = mp.get_context(method)
    q, out = ctx.Queue(), ctx.Queue()
    q.put(torch.arange(1000.0))
    p = ctx.Process(target=reads_one, args=(q, out))
    p.start()
    status, value = out.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    assert status == "ok" and float(value.sum()) == 499500.0, (status, value)
    assert p.exitcode == 0, p.exitcode


def full_dev_shm() -> None:
    """On a full /dev/shm: import, no session, file_descriptor works, file_system raises."""
    import torch

    import torch_mp_ext as mp
    from torch_mp_ext.errors import SharedMemoryError

    assert "TORCH_MP_EXT_SESSION" not in os.environ  # no table could be made: no session
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("tmx_")]
    assert mp.get_sharing_strategy() == "file_descriptor"
    t = mp.empty(1 << 20)
    t.fill_(2)
    assert mp.is_shared(t)
    for method in ("fork", "spawn", "forkserver"):
        _hand_off(mp, method)
    mp.set_sharing_strategy("file_system")
    for make in (lambda: mp.empty(1 << 20), lambda: mp.Queue().put(torch.ones(1 << 18))):
        try:
            make()
        except SharedMemoryError as exc:
            assert exc.errno == errno.ENOSPC, exc
            assert "--shm-size" in str(exc) and "bytes" in str(exc), exc
        else:
            raise AssertionError("file_system allocation on a full /dev/shm did not raise")
    print("ok")


def beyond_memory() -> None:
    """empty(2**40) raises at once and reserves nothing."""
    import torch_mp_ext as mp
    from torch_mp_ext.errors import SharedMemoryLimitError

    before = mp.memory_stats()
    for strategy in ("file_descriptor", "file_system"):
        mp.set_sharing_strategy(strategy)
        start = time.monotonic()
        try:
            mp.empty(2**40)
        except SharedMemoryLimitError as exc:
            assert isinstance(exc, MemoryError) and isinstance(exc, RuntimeError), exc
            assert exc.errno == errno.ENOMEM, exc
            assert str(2**40 * 4) in str(exc) and "Nothing was reserved" in str(exc), exc
        else:
            raise AssertionError("empty(2**40) did not raise")
        assert time.monotonic() - start < 1.0
    assert mp.memory_stats() == before, (before, mp.memory_stats())
    print("ok")


def beyond_cgroup() -> None:
    """In a 1 GiB memory cgroup: 2 GiB is refused at once, naming the cgroup; 64 MiB works."""
    import torch

    import torch_mp_ext as mp
    from torch_mp_ext.errors import SharedMemoryLimitError

    try:
        mp.empty(2 << 30, dtype=torch.uint8)
    except SharedMemoryLimitError as exc:
        assert "memory limit of its cgroup" in str(exc), exc
        print(str(exc))
    else:
        raise AssertionError("2 GiB in a 1 GiB cgroup did not raise")
    assert mp.empty(64 << 20, dtype=torch.uint8).numel() == 64 << 20
    print("ok")


def file_size_limit() -> None:
    """Under ``ulimit -f 4194304`` (4 GiB), unbounded queues work and nothing sends SIGXFSZ."""
    limit = 4194304 * 1024
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it: make it kill, as in C
    import torch

    import torch_mp_ext as mp
    from torch_mp_ext.errors import SharedMemoryError

    for make in (mp.Queue, mp.SimpleQueue, mp.JoinableQueue):
        q = make()
        q.put(torch.ones(3))
        q.put(b"x" * (5 << 20))  # out of line: a block of its own
        assert q.get(timeout=TIMEOUT).sum() == 3 and len(q.get(timeout=TIMEOUT)) == 5 << 20
        assert q.max_bytes < limit
        q.close()
    _hand_off(mp, "fork")
    try:
        mp.empty(5 << 30, dtype=torch.uint8)  # within memory, past the file-size limit
    except SharedMemoryError as exc:
        assert exc.errno == errno.EFBIG and "RLIMIT_FSIZE" in str(exc), exc
    else:
        raise AssertionError("a segment past RLIMIT_FSIZE did not raise")
    print("ok")


def import_and_sleep() -> None:
    """A root that imported the package, then waits to be killed."""
    import torch_mp_ext  # noqa: F401

    print(os.environ["TORCH_MP_EXT_SESSION"], flush=True)
    time.sleep(TIMEOUT)


def just_import() -> None:
    import torch_mp_ext  # noqa: F401

    print("ok")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    globals()[sys.argv[1]]()
