"""Task functions for tests/test_tasks.py (module level: workers import them by name)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import torch

import torch_mp_ext as mp

# ---- the seed's examples (Ray's dynamic generators page), on TaskPool --------------------


def large_values(num_returns, size):
    return [np.random.randint(np.iinfo(np.int8).max, size=(size, 1), dtype=np.int8)
            for _ in range(num_returns)]


def large_values_generator(num_returns, size):
    for i in range(num_returns):
        yield np.random.randint(np.iinfo(np.int8).max, size=(size, 1), dtype=np.int8)
        print(f"yielded return value {i}")


def split(array, chunk_size):
    while len(array) > 0:
        yield array[:chunk_size]
        array = array[chunk_size:]


def get_size(ref_generator, block_size):
    num_elements = 0
    for ref in ref_generator:
        array = mp.get(ref)
        assert len(array) <= block_size
        num_elements += len(array)
    return num_elements


def generator():
    yield from range(2)
    raise Exception("error")


# ---- more ---------------------------------------------------------------------------------


def add(a, b):
    return a + b


def identity(x):
    return x


def count(n):
    yield from range(n)


def pair():
    return [1, "two"]


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def raise_value_error(message):
    raise ValueError(message)


def unpicklable_value():
    return threading.Lock()


def fill_tensor(n, value):
    return torch.full((n,), value)


def add_one_in_place(t):
    t.add_(1)
    return float(t.sum())


def sum_tensor(t):
    return float(t.sum())


def progress_counter(progress, n):
    """Yields 0..n-1 (or forever if n < 0), recording in ``progress`` (an arena array) how
    many values it produced and, in progress[1], that its finally block ran."""
    i = 0
    try:
        while n < 0 or i < n:
            progress[0] = i + 1
            yield i
            i += 1
    finally:
        progress[1] = 1


def yield_then_die(n):
    yield from range(n)
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


def signal_then_sleep(flag, seconds):
    flag[0] = os.getpid()
    time.sleep(seconds)
    return "done"


def die_on_first_attempt(flag, n):
    """Yields 0..n-1; the first time (flag[0] == 0) it dies after value 2."""
    for i in range(n):
        yield i
        if i == 2 and flag[0] == 0:
            flag[0] = 1
            os.kill(os.getpid(), signal.SIGKILL)


_initialized = None


def set_initialized(value):
    global _initialized
    _initialized = value


def get_initialized():
    return _initialized


def failing_initializer():
    raise RuntimeError("initializer failed on purpose")


def worker_arena():
    stats = mp.memory_stats()
    return stats["live_blocks"], stats["live_refs"]


# ---- peak private memory of a worker -------------------------------------------------------

_sampler = {"peak": 0, "base": 0, "stop": None}


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def start_sampler():
    """Samples this worker's private resident memory (RssAnon) every millisecond."""
    stop = threading.Event()
    _sampler.update(base=_rss_anon(), peak=0, stop=stop)

    def sample():
        while not stop.is_set():
            _sampler["peak"] = max(_sampler["peak"], _rss_anon())
            time.sleep(0.001)

    threading.Thread(target=sample, daemon=True).start()
    return _sampler["base"]


def stop_sampler():
    _sampler["stop"].set()
    time.sleep(0.01)
    return _sampler["base"], _sampler["peak"]


def big_list(n):
    return list(range(n))


def length(x):
    return len(x)


def yield_tensor_then_die():
    yield torch.ones(1 << 20)  # 4 MB: a segment of its own, new to the caller
    os.kill(os.getpid(), signal.SIGKILL)


def pid_after(seconds):
    """This worker's pid, after ``seconds`` (so that a batch of calls spreads over workers)."""
    time.sleep(seconds)
    return os.getpid()


def slow_exit(seconds):
    """Makes this worker's exit take ``seconds``: a finalizer of multiprocessing's exit path
    (run after the worker's target returns), as a worker flushing a big file would."""
    from multiprocessing import util

    util.Finalize(None, time.sleep, args=(seconds,), exitpriority=100)
    return os.getpid()


def sleep_in_first_worker(flag, seconds):
    """Initializer: the first worker to start (flag[0] == 0) sleeps ``seconds`` before taking
    tasks, so what is dispatched to it waits unread in its queue; later ones start at once."""
    if flag[0] == 0:
        flag[0] = os.getpid()
        time.sleep(seconds)


def yield_tensor(t, n):
    for _ in range(n):
        yield t
