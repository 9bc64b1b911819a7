"""Module-level child targets (spawn and forkserver import them by name)."""

from __future__ import annotations

import os
import signal
import time

import torch

import torch_mp_ext as mp


def fill_and_ack(q_in, q_out, value):
    """Gets a list of tensors/arrays, fills every one with ``value``, acknowledges."""
    items = q_in.get(timeout=60)
    for item in items:
        item[...] = value
    q_out.put("done")


def send_tensor_twice(q, event):
    t = torch.ones(5, 5)
    q.put(t)
    q.put(t)
    event.wait(60)


def report_strategy(q):
    q.put(mp.get_sharing_strategy())


def echo(q_in, q_out, count):
    for _ in range(count):
        q_out.put(q_in.get(timeout=60))


def hold_then_die(q, event):
    """Receives an item, acknowledges, waits to be killed."""
    item = q.get(timeout=60)
    q.put(("got", os.getpid()))
    event.wait(60)
    del item


def send_named_and_wait(q, event):
    mp.set_sharing_strategy("file_system")
    t = torch.full((1024,), 7.0)
    q.put(t)
    event.wait(60)


def receive_many_under_fd_limit(q, out, count, limit):
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    held = [q.get(timeout=60) for _ in range(count)]
    out.put((len(held), len({t.untyped_storage().data_ptr() for t in held}),
             float(sum(t[0].item() for t in held)), len(os.listdir("/proc/self/fd"))))


def receive_at_fd_limit(q, out):
    """Opens files until EMFILE, then receives a tensor in a segment it has not mapped yet."""
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    try:
        q.get(timeout=60)
        out.put(("received", ""))
    except OSError as e:
        out.put((type(e).__name__, f"{e.errno} {e}"))
    finally:
        for fd in held:
            os.close(fd)


def sigkill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def sleep_forever():
    while True:
        time.sleep(1)


def array_round_trip(q_in, q_out):
    arr = q_in.get(timeout=60)
    arr += 1
    out = mp.empty_array(arr.shape, arr.dtype)
    out[...] = arr * 2
    q_out.put((arr, out))
    q_in.get(timeout=60)  # wait for the parent to be done with both


def counter_decrement(name, segment_id, slot, q):
    """Opens a counter file by name, records itself as the slot's holder, decrements."""
    from torch_mp_ext import _C

    counters = _C.CounterFile.open(name, segment_id)
    counters.set_holder(slot, _C.holder_key())
    q.put(counters.add(slot, -1))


def counter_hold_forever(name, segment_id, slot, q):
    from torch_mp_ext import _C

    counters = _C.CounterFile.open(name, segment_id)
    counters.set_holder(slot, _C.holder_key())
    q.put("holding")
    while True:
        time.sleep(1)


def receive_and_drop(q, out):
    """Receives one item, reports a checksum, drops it and exits normally."""
    item = q.get(timeout=60)
    out.put(float(item.sum()))
    del item


def take_and_count_mappings(q, acks, n):
    """Receives n tensors one at a time; after each, says how many segments it maps."""
    from torch_mp_ext import _C

    for i in range(n):
        t = q.get()
        ok = bool((t == i).all())
        del t
        acks.put((ok, _C.arena_stats()["mapped_segments"]))


def drop_block_handle(handle, q):
    from torch_mp_ext import _C

    block = _C.attach(handle)
    q.put(block.refcount)
    del block


def allocate_and_send_handle(q, named, then):
    """Allocates a block, sends a handle to it, then exits ('exit') or dies ('sigkill')."""
    from torch_mp_ext import _C

    block = _C.allocate(1000, named)
    memoryview(block)[:4] = b"tmx!"
    q.put(block.share())
    if then == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    q.put("bye")


def put_and_return(q, nbytes):
    """The common worker: put a result and return (the process exits right away)."""
    q.put(torch.full((nbytes // 4,), 3.0))


def hold_block_then_die(handle, q):
    """Adopts a block handle, says so, and waits to be SIGKILLed holding it."""
    from torch_mp_ext import _C

    block = _C.attach(handle)
    q.put("holding")
    time.sleep(120)
    del block
