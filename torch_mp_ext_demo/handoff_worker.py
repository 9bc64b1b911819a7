"""One side of the hand-off benchmark: a producer that hands tensors to a consumer process.

Run as a script (``python handoff_worker.py LIB TRANSPORT``), never imported as part of the
package: with LIB=torch the process must not import torch_mp_ext, whose reducers would
replace torch's. It reads JSON commands on stdin, one trial each, and answers on stdout.

Hand-off time: from just before ``put()`` until the consumer holds the object (``get()``
returned), both read from CLOCK_MONOTONIC. The consumer acknowledges, then reads every byte
(a float64 sum) and the producer checks the sum, so a lazy or wrong transfer fails loudly.

Note [Warm hand-offs]
Filling a large tensor right before ``put()`` evicts the CPU caches of both processes (they
share the last-level cache): right after a 128 MB fill, even a 4 KB hand-off costs about
0.5 ms instead of 0.08 ms here, whatever the library. Each timed trial is therefore preceded
by ``warmups`` untimed hand-offs of a 4 KB object of the same library and kind, so the clock
measures the hand-off itself rather than cache refills caused by making the data;
``--warmups 0`` measures the cold case.

Note [Tensor floor]
The least any library can do to hand a tensor to another Python process: the producer
writes where the tensor lies (its offset in a mapping both processes already share, and its
length: 64 bytes, like the pipe floor's message) and the consumer makes a torch tensor there
with ``torch.frombuffer`` before it takes the time, then checks the data like the tensor rows.
No reference is counted, no mapping looked up, nothing is safe against a crash: the library
rows pay for those on top of this.

Note [Idle OpenMP threads spin]
The consumer's check sums the data with torch, which uses every core's OpenMP thread for a
large tensor; after the parallel region those threads spin for a few milliseconds (libgomp's
default wait policy) before they sleep. On 2 CPUs that spinning delayed the *next* trial's
hand-off by 3-4 ms whatever the library (a cold 1 MB hand-off after a 128 MB one: 3.7 ms; with
OMP_NUM_THREADS=1 or OMP_WAIT_POLICY=passive: 0.5 ms). The sides therefore run with
``OMP_NUM_THREADS=1``, so each trial measures its own hand-off.
"""

import json
import mmap
import multiprocessing
import os
import struct
import sys
import time

import numpy as np

_ARENA_BYTES = (128 << 20) + 4096  # the tensor floor's shared mapping: the largest size, then
# a page for its warm-up tensors


def _import_lib(lib):
    if lib == "tmx":
        import torch_mp_ext as mp

        return mp
    if lib == "torch":
        import torch.multiprocessing as mp

        return mp
    return multiprocessing


def consume(lib, transport, q, acks):
    mp = _import_lib(lib)  # registers the library's reducers in this process
    del mp
    while True:
        item = q.get()
        received = time.perf_counter()
        if item is None:
            break
        acks.put(received)
        if isinstance(item, np.ndarray):
            total = float(item.sum(dtype=np.float64))
        else:
            import torch

            total = float(item.sum(dtype=torch.float64))
        del item
        acks.put(total)


def consume_pipe(read_fd, acks, arena):
    """The floors' consumer: a 64-byte message on a plain pipe, acknowledged like the rest.

    A message starting with ``T`` is the tensor floor's (Note [Tensor floor]): the consumer
    makes the tensor it describes on ``arena`` before it takes the time, then checks it as the
    tensor rows do."""
    import torch

    while True:
        data = os.read(read_fd, 4096)
        if data[:1] == b"T":
            offset, numel = struct.unpack_from("<qq", data, 1)
            item = torch.frombuffer(arena, dtype=torch.float32, count=numel, offset=offset)
            received = time.perf_counter()
            acks.put(received)
            acks.put(float(item.sum(dtype=torch.float64)))
            del item
            continue
        received = time.perf_counter()
        if data == b"stop":
            break
        acks.put(received)
        acks.put(float(len(data)))


def make_item(lib, variant, nbytes, value):
    n = nbytes // 4
    if lib == "stdlib":
        return np.full(n, value, dtype=np.float32)
    import torch

    if variant == "preshared":
        if lib == "tmx":
            import torch_mp_ext as mp

            t = mp.empty(n, dtype=torch.float32)
            t.fill_(value)
            return t
        t = torch.full((n,), value, dtype=torch.float32)
        t.share_memory_()
        return t
    return torch.full((n,), value, dtype=torch.float32)


def memcpy_floor(nbytes, repeats=5):
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best.append(time.perf_counter() - start)
    return sorted(best)[len(best) // 2]


def main_pipe():
    """lib "pipe": the floors (Python os.write/os.read on a pipe, the same acknowledgement)."""
    import torch

    ctx = multiprocessing.get_context("fork")  # the consumer inherits the pipe and the arena
    arena = mmap.mmap(-1, _ARENA_BYTES)  # MAP_SHARED | MAP_ANONYMOUS
    read_fd, write_fd = os.pipe()
    acks = ctx.SimpleQueue()
    consumer = ctx.Process(target=consume_pipe, args=(read_fd, acks, arena), daemon=True)
    consumer.start()
    os.close(read_fd)
    base = torch.frombuffer(arena, dtype=torch.uint8, count=1).data_ptr()
    warm = torch.frombuffer(arena, dtype=torch.float32, count=1024, offset=_ARENA_BYTES - 4096)
    warm.fill_(1.0)
    out = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=out, flush=True)
    message = b"x" * 64
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "stop":
            break
        if cmd["variant"] == "tensor":  # Note [Tensor floor]
            numel = cmd["nbytes"] // 4
            value = float(cmd["seq"] % 100 + 1)
            item = torch.frombuffer(arena, dtype=torch.float32, count=numel)
            item.fill_(value)
            for _ in range(cmd.get("warmups", 0)):
                os.write(write_fd, _tensor_message(warm, base))
                acks.get()
                acks.get()
            start = time.perf_counter()
            os.write(write_fd, _tensor_message(item, base))
            received = acks.get()
            total = acks.get()
            del item
            print(json.dumps({"seconds": received - start, "ok": total == value * numel}),
                  file=out, flush=True)
            continue
        for _ in range(cmd.get("warmups", 0)):
            os.write(write_fd, message)
            acks.get()
            acks.get()
        start = time.perf_counter()
        os.write(write_fd, message)
        received = acks.get()
        total = acks.get()
        print(json.dumps({"seconds": received - start, "ok": total == len(message)}), file=out,
              flush=True)
    os.write(write_fd, b"stop")
    consumer.join(60)


def _tensor_message(t, base):
    """The tensor floor's message: where ``t`` lies in the arena, 64 bytes like the pipe
    floor's."""
    return struct.pack("<cqq", b"T", t.data_ptr() - base, t.numel()).ljust(64, b"\0")


def main():
    lib, transport = sys.argv[1], sys.argv[2]
    if lib == "pipe":
        main_pipe()
        return
    mp = _import_lib(lib)
    ctx = mp.get_context("spawn")
    if transport == "queue":
        q, acks = ctx.Queue(), ctx.Queue()
    else:
        q, acks = ctx.SimpleQueue(), ctx.SimpleQueue()
    consumer = ctx.Process(target=consume, args=(lib, transport, q, acks), daemon=True)
    consumer.start()
    out = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "stop":
            break
        if cmd["op"] == "memcpy":
            print(json.dumps({"seconds": memcpy_floor(cmd["nbytes"])}), file=out, flush=True)
            continue
        if lib != "stdlib":
            mp.set_sharing_strategy(cmd["strategy"])
        value = float(cmd["seq"] % 100 + 1)
        item = make_item(lib, cmd["variant"], cmd["nbytes"], value)
        for _ in range(cmd.get("warmups", 0)):  # Note [Warm hand-offs]
            warm = make_item(lib, cmd["variant"], 4096, 1.0)
            q.put(warm)
            acks.get()
            acks.get()
            del warm
        start = time.perf_counter()
        q.put(item)
        received = acks.get()
        total = acks.get()
        del item
        expected = value * (cmd["nbytes"] // 4)
        print(json.dumps({"seconds": received - start, "ok": total == expected}), file=out,
              flush=True)
    q.put(None)
    consumer.join(60)


if __name__ == "__main__":
    main()
