"""Module-level stages and sources for the pipeline and ArrayQueue tests (spawn and forkserver
import them by name)."""

from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import torch

import torch_mp_ext as mp

# ---- sources ------------------------------------------------------------------------------


def count(n=20):
    yield from range(n)


def arrays(n=20, shape=(256, 1024)):
    """n float64 arrays (2 MiB each by default), array i filled with i."""
    for i in range(n):
        yield np.full(shape, float(i))


def tensors(n=10):
    for i in range(n):
        yield torch.full((128, 1024), float(i))


def raising_source(n=5):
    yield from range(n)
    raise ValueError(f"source gave up after {n} items")


def forever():
    i = 0
    while True:
        yield i
        i += 1


# ---- generator stages ---------------------------------------------------------------------


def square(items):
    for x in items:
        yield x * x


def pairs(items):
    """Two outputs per input: generator stages need not be one-to-one."""
    for x in items:
        yield x
        yield -x


def batches(items, size=3):
    batch = []
    for x in items:
        batch.append(x)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def raise_on_gen(items, bad=5):
    for x in items:
        if x == bad:
            raise ValueError(f"generator stage refused {x}")
        yield x


def describe_arrays(items):
    """(value, lives in a block) for each array it receives."""
    for x in items:
        yield float(np.asarray(x).flat[0]), mp.is_shared(x)


# ---- per-item stages ----------------------------------------------------------------------


def plus_one(x):
    return x + 1


def jitter(x):
    time.sleep(random.random() * 0.01)
    return x


def raise_on(x, bad=5):
    if x == bad:
        raise ValueError(f"per-item stage refused {x}")
    return x


def kill_self_on(x, bad=3):
    if x == bad:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def sleep_forever(x):
    time.sleep(3600)
    return x


def unpicklable_error(x):
    raise _LocalError(lambda: x)


class _LocalError(Exception):
    """An exception that cannot be pickled (it holds a lambda)."""

    def __init__(self, fn):
        super().__init__("an unpicklable error")
        self.fn = fn


def exit_quietly(x):
    os._exit(0)


def pid_of(x):
    return os.getpid()


@mp.stage(2)
def decorated_square(items):
    for x in items:
        yield x * x


@mp.stage(2)
def decorated_negate(items):
    for x in items:
        yield -x


@mp.stage(buffer_size=1)
def decorated_raise(items):
    for x in items:
        if x == 4:
            raise KeyError("decorated stage refused 4")
        yield x


def megabyte_arrays(n=300):
    """n arrays of exactly 1 MiB (each computed here, so born in a block)."""
    for i in range(n):
        yield np.full((128, 1024), float(i))


# ---- ArrayQueue ---------------------------------------------------------------------------


def aq_produce(aq, n, in_place):
    """Puts n arrays (filled with i) and a final "done": copied, or made in a free block."""
    for i in range(n):
        if in_place:
            a = aq.new_array(timeout=30)
            a[...] = i
        else:
            a = np.full(aq.shape, float(i))
        aq.put(a, timeout=30)
        del a
    aq.put("done", timeout=30)


def aq_consume(aq, results):
    """Gets until "done", sending back (first value, still a shared view) for each array."""
    while True:
        item = aq.get(timeout=30)
        if isinstance(item, str):
            results.put(item)
            return
        results.put((float(item.flat[0]), mp.is_shared(item)))
        del item


def aq_stage(items):
    """A pipeline stage whose results travel through an ArrayQueue made in this process."""
    aq = mp.ArrayQueue(np.zeros((64, 1024)), 2)
    for x in items:
        out = aq.new_array(timeout=30)
        np.multiply(x, 2, out=out)
        aq.put(out, timeout=30)
        del out
        yield float(aq.get(timeout=30)[0, 0])
