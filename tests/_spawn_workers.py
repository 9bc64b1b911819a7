"""Module-level targets for tests/test_spawn*.py (spawn and forkserver import them by name).

Each is ``fn(i, *args)`` as ``start_processes`` calls it.
"""

from __future__ import annotations

import ctypes
import datetime
import mmap
import os
import signal
import sys
import tempfile
import time

import torch

import torch_mp_ext as mp


def put_index(i, q):
    q.put(i)


def succeed(i, *_):
    torch.ones(4).add_(i)


def report(i, q):
    """Puts what a test wants to know about the worker."""
    from torch_mp_ext.processes import forkserver as _forkserver

    main = sys.modules.get("__mp_main__") or sys.modules["__main__"]
    q.put({
        "index": i,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "env": os.environ.get("TMX_TEST_VAR"),
        "strategy": mp.get_sharing_strategy(),
        "main_mark": getattr(main, "MARK", None),
        "server": _forkserver.server_pid(),
    })


def report_ppid(q):
    """A plain Process target: puts its parent's pid."""
    q.put(os.getppid())


def raise_at(i, ranks, delay=0.0):
    """Ranks in ``ranks`` raise ValueError (after ``delay`` s); the others return."""
    if i in ranks:
        time.sleep(delay)
        raise ValueError(f"legitimate exception from process {i}")
    time.sleep(0.5)


class NeedsTwoArgs(Exception):
    """Pickles, but does not unpickle (its __init__ wants two arguments)."""

    def __init__(self, a, b):
        super().__init__(f"{a} {b}")


def raise_unpicklable(i):
    raise NeedsTwoArgs("odd", "exception")


def _bus_error():
    with tempfile.TemporaryFile() as f:
        f.truncate(2 * mmap.PAGESIZE)
        m = mmap.mmap(f.fileno(), 2 * mmap.PAGESIZE)
        f.truncate(0)  # the mapping now reaches past the end of its file
        m[mmap.PAGESIZE] = 1  # SIGBUS, as a write to an over-full /dev/shm


def crash(i, how):
    """Rank 0 dies by ``how``; the others wait to be stopped."""
    if i == 0:
        if how == "segv":
            ctypes.string_at(0)
        elif how == "bus":
            _bus_error()
        elif how == "abort":
            os.abort()
        elif how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "exit":
            sys.exit(7)
    time.sleep(60)


def ignore_sigterm(i):
    """Rank 0 fails; the others ignore SIGTERM and would sleep for a minute."""
    if i == 0:
        time.sleep(0.3)
        raise RuntimeError("rank 0 failed")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)


def exhaust_memory(i, cgroup_dir):
    """Moves into a memory-limited cgroup, then allocates past its limit."""
    with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    hog = []
    for _ in range(64):
        hog.append(bytearray(16 << 20))  # touched: bytearray zero-fills


def ready_then_sleep(i, q):
    q.put(os.getpid())
    time.sleep(60)


def nested_sleeper(i, q):
    q.put(os.getpid())
    time.sleep(120)


def start_grandchild_and_sleep(i, q, start_method):
    """Reports [its pid, its own fast forkserver's] and a grandchild's pid, then sleeps."""
    from torch_mp_ext.processes import forkserver as _forkserver

    mp.start_processes(nested_sleeper, args=(q,), nprocs=1, join=False, start_method=start_method)
    q.put([os.getpid(), _forkserver.server_pid()])
    time.sleep(120)


DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
            "OMP_NUM_THREADS")


def dist_env(local_rank):
    """The environment launch() gave this worker (None for a variable it did not set)."""
    return {k: os.environ.get(k) for k in DIST_ENV}


def all_reduce(local_rank):
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    out = (dist.get_rank(), dist.get_world_size(), t.item(), dist.is_torchelastic_launched(),
           dist_env(local_rank))
    dist.destroy_process_group()
    return out


def fail_first_attempt(local_rank, message):
    """Raises in local rank 1 of the first attempt; returns the attempt number otherwise."""
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and local_rank == 1:
        raise ValueError(message)
    return attempt


def print_rank(local_rank):
    print(f"stdout of rank {os.environ['RANK']}", flush=True)
    print(f"stderr of rank {os.environ['RANK']}", file=sys.stderr, flush=True)


class FailsOnSecondPickle:
    """Pickles once (in the parent), then refuses: the second process fails to start."""

    pickled = 0

    def __reduce__(self):
        FailsOnSecondPickle.pickled += 1
        if FailsOnSecondPickle.pickled > 1:
            raise TypeError("cannot pickle this twice")
        return (FailsOnSecondPickle, ())
