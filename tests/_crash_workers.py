"""Workers for tests/test_crash_consistency.py (module level: spawn and forkserver import them
by name)."""

from __future__ import annotations

import os
import pickle
import signal
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch


def hold_queue_twice_then_sleep(q, ready):
    """Holds q's ring through two queue objects (the inherited one and a copy), says so, and
    waits to be killed."""
    extra = pickle.loads(ForkingPickler.dumps(q))
    ready.put(os.getpid())
    time.sleep(60)
    del extra


def tagged(i):
    """Item i of a stream that mixes tensors and arrays, each filled with i: in tuples
    (pickled), or bare (a lean record: Note [Lean tensor records]) every other time."""
    if i % 4 == 1:
        return torch.full((64,), float(i))
    if i % 4 == 3:
        import torch_mp_ext as mp

        arr = mp.empty_array((16384,))
        arr.fill(float(i))
        return arr
    if i % 2:
        return ("tensor", i, torch.full((64,), float(i)))
    return ("array", i, np.full((16384,), float(i)))


def unpack(item):
    """(kind, i, data) of a tagged item, bare or in its tuple."""
    if isinstance(item, torch.Tensor):
        return "tensor", int(item[0]), item
    if isinstance(item, np.ndarray):
        return "array", int(item[0]), item
    return item


def wrong(items, start=0):
    """How many of `items` are not tagged(start), tagged(start + 1), ... exactly."""
    bad = 0
    for k, item in enumerate(items):
        kind, i, x = unpack(item)
        want = torch.Tensor if kind == "tensor" else np.ndarray
        ok = (i == start + k and isinstance(x, want) and x.shape[0] in (64, 16384)
              and bool((x == float(i)).all()))
        bad += not ok
    return bad


def tagged_values(n, start):
    return [tagged(start + k) for k in range(n)]


def signal_then_sleep(flag, seconds):
    flag[0] = os.getpid()
    time.sleep(seconds)


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def identity(x):
    return x


def die_in_doorbell(q, point, op):
    """SIGKILLed at `point` of the doorbell protocol (_queue_compat.CRASH_*) in a put or get."""
    from torch_mp_ext import _C

    _C.Ring.set_crash_point(point)
    if op == "put":
        q.put("from the dead")
    else:
        q.get()
    os._exit(3)  # not reached: the crash point kills first


def make_tensors_then_die(n, ready):
    """Creates n tensors in shared memory (never sent anywhere) and frees one more (its pooled
    segment stays cached: Note [Pooled names]), says so, is SIGKILLed."""
    import torch_mp_ext as mp

    freed = mp.empty(1 << 20)
    del freed
    kept = [mp.empty(1000) for _ in range(n)]
    kept += [mp.empty_array((10_000,), np.float64) for _ in range(n)]
    ready.put(os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)
    del kept


# ---- the kill-anywhere harness (tests/_kill_anywhere.py) ------------------------------------


def _arm(point):
    """Positive: a ring crash point (_C.set_crash_point); negative: a doorbell one."""
    from torch_mp_ext import _C

    if point != 0:
        _C.Ring.set_crash_point(abs(point))


def produce_tagged(q, n, point):
    _arm(point)
    for i in range(n):
        q.put(tagged(i))
    os._exit(0)


def consume(q, n, point):
    _arm(point)
    held = []
    for _ in range(n):
        held.append(q.get())  # received tensors are held when the kill comes
    os._exit(0)


def tagged_source(n=30):
    for i in range(n):
        yield tagged(i)


def pass_through(items):
    yield from items


def publish_forever(ch):
    import torch as _torch

    version = 2
    template = {f"w{i}": _torch.zeros(20_000) for i in range(8)}
    while True:
        ch.publish({k: _torch.full_like(v, float(version)) for k, v in template.items()},
                   version=version)
        version += 1
