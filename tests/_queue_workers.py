"""Module-level child targets for the queue tests (spawn and forkserver import them by name)."""

from __future__ import annotations

import os
import queue
import time
import zlib

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
        for item in items:
            if item is None:
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


def make_payload(producer, seq, size):
    body = bytes((producer * 31 + seq + k) % 251 for k in range(min(size, 64))) * (
        size // 64 + 1)
    body = body[:size]
    return (producer, seq, zlib.crc32(body), body)


def check_payload(item):
    producer, seq, crc, body = item
    return zlib.crc32(body) == crc


def steady_producer(q, producer, stop, sizes):
    seq = 0
    while not stop.is_set():
        try:
            q.put(make_payload(producer, seq, sizes[seq % len(sizes)]), timeout=0.5)
            seq += 1
        except queue.Full:
            pass


def steady_consumer(q, out, stop):
    """Gets until told to stop; reports (producer, seq) of every item and the torn count."""
    seen, torn = [], 0
    while True:
        try:
            item = q.get(timeout=0.2)
        except queue.Empty:
            if stop.is_set():
                break
            continue
        if not check_payload(item):
            torn += 1
        seen.append(item[:2])
    out.put((seen, torn), timeout=TIMEOUT)


def victim_producer(q, producer, sizes, report_fd):
    """Puts as fast as it can until it is killed; reports each committed seq on a pipe."""
    seq = 0
    while True:
        q.put(make_payload(producer, seq, sizes[seq % len(sizes)]), timeout=TIMEOUT)
        os.write(report_fd, seq.to_bytes(4, "little"))
        seq += 1


def victim_consumer(q, report_fd):
    """Gets as fast as it can until it is killed; reports each item it got on a pipe."""
    while True:
        try:
            item = q.get(timeout=0.05)
        except queue.Empty:
            continue
        ok = check_payload(item)
        os.write(report_fd, item[0].to_bytes(2, "little") + item[1].to_bytes(4, "little")
                 + bytes([ok]))
