"""Module-level child targets for the queue tests (spawn and forkserver import them by name)."""

from __future__ import annotations

import os
import queue
import signal
import struct
import time

import numpy as np
import torch

import torch_mp_ext as mp
from torch_mp_ext import _C

TIMEOUT = 60


# ---- raw ring -----------------------------------------------------------------------------


def ring_die_at(handle, point, op, payload):
    """Opens the ring, arms a crash point and runs one operation: the process SIGKILLs itself."""
    ring = _C.Ring.open(_C.attach(handle))
    _C.Ring.set_crash_point(point)
    if op == "put":
        ring.put(payload, 0, 5.0)
    else:
        ring.get(5.0)
    os._exit(3)  # not reached when the crash point fires


def ring_hold_forever(handle, ready):
    """Takes the ring's mutex (crash point 1 fires while it is held)."""
    ring = _C.Ring.open(_C.attach(handle))
    ready.set()
    _C.Ring.set_crash_point(1)
    ring.put(b"never", 0, 5.0)


# ---- queues -------------------------------------------------------------------------------


def echo(q_in, q_out, count):
    for _ in range(count):
        q_out.put(q_in.get(timeout=TIMEOUT), timeout=TIMEOUT)


def echo_simple(q_in, sq_out, count):
    for _ in range(count):
        sq_out.put(q_in.get(timeout=TIMEOUT))


def put_simple(sq, producer, count):
    for i in range(count):
        sq.put((producer, i))


def produce_sequence(q, producer, count, batch):
    """Puts (producer, i) for i in range(count), one by one or put_many in batches."""
    if batch:
        for start in range(0, count, batch):
            q.put_many([(producer, i) for i in range(start, min(start + batch, count))],
                       timeout=TIMEOUT)
    else:
        for i in range(count):
            q.put((producer, i), timeout=TIMEOUT)


def consume_until_none(q, out, batch):
    """Gets items until None, sends back everything it got (in the order it got them)."""
    got = []
    while True:
        items = q.get_many(batch, timeout=TIMEOUT) if batch else [q.get(timeout=TIMEOUT)]
        for k, item in enumerate(items):
            if item is None:
                extra = items[k + 1:]  # other consumers' sentinels: give them back
                if extra:
                    q.put_many(extra, timeout=TIMEOUT)
                out.put(got, timeout=TIMEOUT)
                return
            got.append(item)


def mutate_received(q_in, q_out):
    """Gets a nested item of tensors and arrays, mutates every leaf in place, acknowledges."""
    item = q_in.get(timeout=TIMEOUT)
    item["tensor"].add_(1)
    item["nested"][0].fill_(7)
    item["nested"][1]["array"][:] = 3
    item["view"].fill_(-1)
    q_out.put(("done", item["tensor"].untyped_storage().data_ptr() != 0), timeout=TIMEOUT)
    q_in.get(timeout=TIMEOUT)  # hold the item until the parent has looked


def put_tensors_and_exit(q, count):
    for i in range(count):
        q.put(mp.zeros(256) + i, timeout=TIMEOUT)


def joinable_worker(q, results):
    while True:
        item = q.get(timeout=TIMEOUT)
        if item is None:
            q.task_done()
            return
        time.sleep(0.01)
        results.put(item * 2, timeout=TIMEOUT)
        q.task_done()


def put_then_close(q, count):
    for i in range(count):
        q.put(i, timeout=TIMEOUT)
    q.close()
    q.join_thread()


# ---- pool / executor ----------------------------------------------------------------------


def simple_pool_fill(tensor):
    """PyTorch's test_multiprocessing helper: fill the input in place, return a new tensor."""
    tensor.fill_(4)
    return tensor.add(1)


def square(x):
    return x * x


class TensorDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.arange(8, dtype=torch.float32) + i, "y": i,
                "z": np.full(4, i, dtype=np.int64)}


# ---- the SIGKILL test's processes ---------------------------------------------------------

_FILLERS = {}


def _filler(size):
    if size not in _FILLERS:
        _FILLERS[size] = bytes((k * 7 + size) % 251 for k in range(size))
    return _FILLERS[size]


def make_payload(producer, seq, size):
    """(producer, seq, body): the body names its item at both ends around a known filler, so
    any mix of two frames (a torn item) fails check_payload."""
    tag = struct.pack("<II", producer, seq)
    return (producer, seq, tag + _filler(size) + tag)


def check_payload(item):
    producer, seq, body = item
    tag = struct.pack("<II", producer, seq)
    return body[:8] == tag and body[-8:] == tag and body[8:-8] == _filler(len(body) - 16)


def steady_producer(q, producer, stop, sizes, out):
    seq = 0
    while not stop.is_set():
        try:
            q.put(make_payload(producer, seq, sizes[seq % len(sizes)]), timeout=0.5)
            seq += 1
        except queue.Full:
            pass
    out.put(("produced", seq), timeout=TIMEOUT)


def steady_consumer(q, out, stop):
    """Gets until told to stop; reports (producer, seq) of every item and the torn count."""
    seen, torn = [], 0
    while True:
        try:
            items = q.get_many(32, timeout=0.2)
        except queue.Empty:
            if stop.is_set():
                break
            continue
        for item in items:
            if isinstance(item, str):  # the parent's "still alive?" probe
                seen.append((item, -1))
                continue
            if not check_payload(item):
                torn += 1
            seen.append(item[:2])
    out.put(("consumed", seen, torn), timeout=TIMEOUT)


def victim_producer(q, producer, sizes, report_fd, crash_point=0):
    """Puts batches as fast as it can until it is killed (or dies at `crash_point`, a step of
    Note [Ring commit]); reports committed seqs on a pipe."""
    _C.Ring.set_crash_point(crash_point)
    seq = 0
    while True:
        batch = [make_payload(producer, seq + k, sizes[(seq + k) % len(sizes)]) for k in range(4)]
        q.put_many(batch, timeout=TIMEOUT)
        os.write(report_fd, b"".join((seq + k).to_bytes(4, "little") for k in range(4)))
        seq += 4


def victim_consumer(q, report_fd, crash_point=0):
    """Gets batches as fast as it can until it is killed (or dies at `crash_point`); reports
    what it got on a pipe."""
    _C.Ring.set_crash_point(crash_point)
    while True:
        try:
            items = q.get_many(8, timeout=0.05)
        except queue.Empty:
            continue
        os.write(report_fd, b"".join(
            item[0].to_bytes(2, "little") + item[1].to_bytes(4, "little")
            + bytes([check_payload(item)]) for item in items))


# ---- unbounded queues and large items (test_queue_unbounded.py) ---------------------------


def check_in_order(q, n, item_bytes, out):
    """Gets n items (i, payload) and reports whether they came in order, whole."""
    ok = True
    for i in range(n):
        k, payload = q.get(timeout=60)
        ok &= k == i and len(payload) == item_bytes
    out.put(ok)


def identity(x):
    return x


def echo_through(q_in, q_out):
    q_out.put(q_in.get())


def raise_big_value_error(x):
    raise ValueError("x" * 1_000_000)


class BigStringDataset(torch.utils.data.Dataset):
    """Items of 100 KB strings: a batch of 64 pickles to more than 4 MiB of non-tensor data."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        return {"i": i, "s": chr(ord("a") + i % 26) * 100_000}


def put_big_then_die(q, nbytes):
    q.put(b"d" * nbytes)
    os.kill(os.getpid(), signal.SIGKILL)
