"""TaskPool messages dropped unread release every shared-memory reference inside them
(Note [Dropped wires] in ``tasks/values.py``): a task dispatched to a worker that dies before
reading it, items nobody will read, wires nested in values and boxed ones."""

from __future__ import annotations

import gc
import os
import signal
import time

import _task_workers as tw
import pytest
import torch

import torch_mp_ext as mp
from torch_mp_ext import _C
from torch_mp_ext.errors import WorkerDiedError
from torch_mp_ext.tasks import worker as W
from torch_mp_ext.tasks.refs import Entry, Ref
from torch_mp_ext.tasks.values import INLINE_MAX, Value, encode

T = 30.0  # seconds: the most any single wait in these tests may take


def _refcount(t):
    block = _C.attach(_C.share_address(t.untyped_storage().data_ptr(),
                                       t.untyped_storage().nbytes())[0])
    return block.refcount  # counted per process (and per message in flight), not per object


def _released(t, timeout=10.0):
    """True once ``t``'s block has only ``t``'s own reference again. What a pool drops may
    go a moment after ``shutdown()`` returns (a Queue object in a reference cycle goes with
    the garbage collector), so this waits for it; 10 s is a loaded machine, a leak is for
    ever."""
    deadline = time.monotonic() + timeout
    while _refcount(t) != 1:
        if time.monotonic() > deadline:
            return False
        gc.collect()
        time.sleep(0.02)
    return True


def _drop_unread(msg):
    """Puts ``msg`` on a queue and lets the queue go without reading it."""
    q = mp.Queue()
    q.put(msg)
    q.close()
    q.join_thread()
    del q  # the last holder drains the ring: release_frame on the frame


@pytest.mark.parametrize("make", [
    pytest.param(lambda t: encode(t), id="inline"),
    pytest.param(lambda t: encode([t, b"x" * (INLINE_MAX + 1)]), id="boxed"),
    pytest.param(lambda t: encode([Ref(Entry((1, 0, "f"), Value.from_wire(encode(t))))]),
                 id="nested-ref"),
])
@pytest.mark.parametrize("frame", ["ITEM", "TASK", "DONE"])
def test_a_dropped_task_frame_releases_its_wires(make, frame):
    t = mp.zeros(1000)
    assert _refcount(t) == 1
    wire = make(t)
    if frame == "TASK":  # what _dispatch sends: a copy of the payload's references
        payload = Value.from_wire(wire)
        msg = (W.TASK, 1, payload.to_wire(), W.MODE_ONE, 1, 0, 0, 0)
        del payload
    elif frame == "ITEM":
        msg = (W.ITEM, 0, 1, 0, wire)
    else:
        msg = (W.DONE, 0, 1, 0, wire, W.FLAG_OK)
    del wire
    before = _refcount(t)
    assert before > 1  # the frame holds its wire's references
    _drop_unread(msg)
    del msg
    assert _refcount(t) == 1


def test_a_task_in_the_queue_of_a_worker_that_dies_releases_its_arguments():
    """The TASK frame sits unread in the queue of a worker still in its initializer; the
    worker is SIGKILLed: the queue goes, and with it the frame's references to the argument."""
    flag = mp.zeros(1, dtype=torch.int64)
    pool = mp.TaskPool(1, start_method="fork", initializer=tw.sleep_in_first_worker,
                       initargs=(flag, 60.0))
    t = mp.zeros(1000)  # after the fork: no worker holds it but through the frame
    try:
        ref = pool.submit(tw.sum_tensor, t)
        deadline = time.monotonic() + T
        while flag[0] == 0:  # its initializer began: the task is in its queue, unread
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.01)
        assert _refcount(t) >= 2
        os.kill(int(flag[0]), signal.SIGKILL)
        with pytest.raises(WorkerDiedError):
            ref.get(timeout=T)
    finally:
        pool.shutdown(wait=True)
    del ref, pool
    assert _released(t), _refcount(t)


def test_items_nobody_reads_release_their_values_when_the_pool_stops():
    """A streaming task's items the pool never read (it was terminated) go with the result
    queue, releasing the tensor each one carries."""
    pool = mp.TaskPool(1, start_method="fork")
    t = mp.zeros(1000)  # after the fork: no worker holds it but through the frames
    try:
        gen = pool.submit(tw.yield_tensor, t, 5, num_returns="streaming")
        assert gen.join(timeout=T)
        msgs = [(W.ITEM, 0, 10**9, i, encode(t)) for i in range(3)]  # for no task
        pool._results.put_many(msgs)
        del msgs
        pool._terminate()  # Note [Exit]: what happens at exit to a pool not shut down
    finally:
        pool.shutdown(wait=True)
    del gen, pool
    assert _released(t), _refcount(t)


def test_values_of_a_stream_dropped_or_cancelled_unread_are_released():
    """Items that arrive for a cancelled stream, or one whose generator was dropped without
    being read, are released through the same dropper as a dropped frame's."""
    pool = mp.TaskPool(1, start_method="fork")
    t = mp.zeros(1000)  # after the fork: no worker holds it but through the messages
    try:
        gen = pool.submit(tw.yield_tensor, t, 200, num_returns="streaming")
        first = next(gen)
        gen.cancel()
        assert gen.join(timeout=T)
        del first, gen
        gen = pool.submit(tw.yield_tensor, t, 200, num_returns="streaming")
        del gen  # RefGenerator.__del__ cancels it
        assert pool.submit(tw.add, 1, 2).get(timeout=T) == 3  # after the stream, one worker
    finally:
        pool.shutdown(wait=True)
    del pool
    assert _released(t), _refcount(t)
