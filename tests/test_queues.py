"""torch_mp_ext.queues: the multiprocessing API, its errors, real processes, zero-copy items."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict

import _queue_workers as workers
import numpy as np
import pytest
import torch

import torch_mp_ext as mp
from torch_mp_ext import _C
from torch_mp_ext.errors import QueueClosedError
from torch_mp_ext.queues import JoinableQueue, Queue, SimpleQueue

T = 30  # every blocking call in these tests has a timeout


def test_contexts_return_our_queues(start_method):
    ctx = mp.get_context(start_method)
    assert type(ctx.Queue()) is Queue
    assert type(ctx.JoinableQueue(3)) is JoinableQueue
    assert type(ctx.SimpleQueue()) is SimpleQueue
    assert type(mp.Queue()) is Queue and type(mp.SimpleQueue()) is SimpleQueue


def test_put_get_and_the_stdlib_exceptions():
    q = Queue(maxsize=2)
    assert q.empty() and not q.full() and q.qsize() == 0
    q.put(1)
    q.put_nowait((2, "two"))
    assert q.full() and q.qsize() == 2
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    t0 = time.monotonic()
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 5
    with pytest.raises(queue.Full):
        q.put(3, block=False, timeout=10)  # block=False ignores the timeout, as in the stdlib
    assert q.get() == 1 and q.get_nowait() == (2, "two")
    with pytest.raises(queue.Empty):
        q.get_nowait()
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 5
    with pytest.raises(queue.Empty):
        q.get(timeout=-1)  # negative: do not wait, as multiprocessing does


def test_timeout_none_blocks_until_an_item_arrives():
    q = Queue()
    threading.Timer(0.3, q.put, args=("late",)).start()
    t0 = time.monotonic()
    assert q.get() == "late"  # timeout=None: no hidden default timeout (faster-fifo's 10 s)
    assert time.monotonic() - t0 >= 0.25


def test_items_of_every_kind_round_trip():
    q = Queue()
    items = [None, True, 7, 2**100, 1.5, "text", b"raw bytes", bytearray(b"ba"), (1, (2, 3)),
             [1, [2]], {"k": {1, 2}}, frozenset({3}), np.float32(2.5), complex(1, 2),
             Counter("aab"), b"", "", ()]
    for item in items:
        q.put(item)
    assert [q.get(timeout=T) for _ in items] == items
    q.put_many(items)
    assert q.get_many(100, timeout=T) == items


def test_one_batch_mixes_every_path_an_item_can_take():
    """put_many's loop has a branch per kind (plain values and tuples pickled inline, tensors
    and arena arrays as records, anything else pickled, large pickles out of line): a batch
    mixing them all comes back equal, in order."""
    q = Queue(max_bytes=4096)
    t = torch.arange(6.0).view(2, 3)
    a = mp.empty_array((3,), dtype=np.int64)
    a[:] = [4, 5, 6]
    big = "s" * 10_000  # a plain value whose pickle goes out of line
    items = [7, (1, 2.0, "x"), (1, [2]), t, a, big, (t,), None, (big,), b"b", [3]]
    q.put_many(items, timeout=T)
    got = q.get_many(len(items), timeout=T)
    assert len(got) == len(items)
    assert type(got[3]) is torch.Tensor and torch.equal(got[3], t)
    assert type(got[4]) is np.ndarray and got[4].tolist() == [4, 5, 6]
    assert type(got[6]) is tuple and torch.equal(got[6][0], t)
    plain = [0, 1, 2, 5, 7, 8, 9, 10]
    assert [got[i] for i in plain] == [items[i] for i in plain]


def test_put_many_get_many():
    q = Queue(maxsize=10)
    q.put_many(range(4))
    q.put_many([])  # nothing to do
    assert q.get_many(3) == [0, 1, 2]
    assert q.get_many(10) == [3]
    with pytest.raises(queue.Empty):
        q.get_many(5, timeout=0.1)
    with pytest.raises(ValueError, match="max_items"):
        q.get_many(0)
    q.put_many(range(8))
    with pytest.raises(queue.Full):
        q.put_many(range(5), block=False)  # all or nothing
    assert q.qsize() == 8
    with pytest.raises(ValueError, match="maxsize"):
        q.put_many(range(11))


def test_unpicklable_item_raises_at_the_call_site_and_the_queue_stays_usable():
    q = Queue()
    with pytest.raises(TypeError, match="pickle") as info:
        q.put({"lock": threading.Lock()})
    if hasattr(info.value, "__notes__"):
        assert "item of type dict" in info.value.__notes__[0]
    with pytest.raises(Exception) as info:  # (a lambda would go by value: issue 30)
        q.put_many([1, threading.Lock()])  # nothing of the batch is put
    assert q.empty()
    # torch's own refusal comes through unchanged (test_non_leaf_variable_sharing)
    var = torch.arange(1.0, 26).view(5, 5).requires_grad_() * 2
    with pytest.raises(RuntimeError, match="requires_grad"):
        q.put(var)
    q.put("fine")
    assert q.get(timeout=T) == "fine"


def test_items_larger_than_max_bytes_go_out_of_line():
    # Note [Large items out of line]: an explicit max_bytes bounds the ring, not the items.
    q = Queue(max_bytes=1024)
    q.put(b"x" * 2000)
    q.put(list(range(1000)))
    q.put_many([b"x" * 600, b"y" * 600])
    assert q.max_bytes == 1024 and q.qsize() == 4
    assert q.get(timeout=T) == b"x" * 2000
    assert q.get(timeout=T) == list(range(1000))
    assert q.get_many(2, timeout=T) == [b"x" * 600, b"y" * 600]
    with pytest.raises(ValueError, match="never fit"):
        q.put_many([1] * 200)  # 200 frames can never fit in 1024 bytes: at once, no hang
    q.put_many([1] * 30)
    with pytest.raises(queue.Full):  # an explicit max_bytes still bounds the ring
        q.put_many([1] * 40, timeout=0.1)
    assert q.get_many(100, timeout=T) == [1] * 30
    with pytest.raises(ValueError, match="max_bytes"):
        Queue(max_bytes=0)


def test_unbounded_queue_grows_and_shrinks_back_in_order():
    q = Queue()
    first = q._ring.capacity
    for i in range(12_000):  # about 12 MB of frames: three times the initial ring
        q.put((i, b"z" * 1000), block=False)  # never Full: the ring grows
    assert q._ring.capacity > first and q.qsize() == 12_000 and not q.full()
    assert [q.get(timeout=T)[0] for _ in range(12_000)] == list(range(12_000))
    assert q._ring.capacity == first  # emptied: back to its first pages


def test_tensors_and_arrays_count_for_a_handle_not_their_size():
    q = Queue(max_bytes=4096)
    big = torch.zeros(1_000_000)  # 4 MB: pickled as a block handle
    q.put(big)
    out = q.get(timeout=T)
    assert out.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()


def test_closed_queue_behaviour():
    q = Queue()
    with pytest.raises(AssertionError, match="not closed"):
        q.join_thread()
    q.cancel_join_thread()
    q.put(1)
    q.close()
    q.close()  # idempotent
    q.join_thread()
    for call in (lambda: q.put(2), lambda: q.get(), lambda: q.get_nowait(), lambda: q.qsize(),
                 lambda: q.put_many([1]), lambda: q.get_many(1), lambda: pickle.dumps(q)):
        with pytest.raises(ValueError, match="is closed") as info:
            call()
        assert isinstance(info.value, QueueClosedError)


def test_a_closed_queue_still_referenced_holds_no_memory_and_no_fd():
    """close() lets go of the ring's block at once: a closed queue kept alive (by a
    traceback's frame, a list, a pipeline object) must not keep its segment mapped or its
    memfd open until the object is collected (CI caught four such fds after a failed test)."""
    from conftest import open_fds, shm_entries

    fds, shm = open_fds(), shm_entries()
    queues = [Queue(), JoinableQueue(), SimpleQueue()]
    for q in queues:
        q.put(torch.ones(4))
        item = q.get() if isinstance(q, SimpleQueue) else q.get(timeout=T)  # it is there
        assert item.sum().item() == 4
        del item  # its block keeps its own segment mapped
        q.close()
    mp.empty_cache()
    assert open_fds() - fds == set() and shm_entries() - shm == set()
    assert all(q._ring.block is None for q in queues)


def test_close_wakes_a_thread_blocked_in_get():
    q = Queue()
    errors = []

    def blocked():
        try:
            q.get(timeout=T)
        except Exception as exc:  # noqa: BLE001  (the test asserts which)
            errors.append(exc)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    q.close()
    t.join(T)
    assert len(errors) == 1 and isinstance(errors[0], QueueClosedError)
    assert time.monotonic() - t0 < 2


def test_joinable_queue_semantics():
    q = JoinableQueue()
    with pytest.raises(ValueError, match="too many"):
        q.task_done()
    q.put("a")
    q.put_many(["b", "c"])
    assert q.join(timeout=0.1) is False
    for _ in range(3):
        q.get(timeout=T)
        q.task_done()
    assert q.join(timeout=T) is True
    assert q.join() is None  # as multiprocessing's
    with pytest.raises(ValueError, match="too many"):
        q.task_done()


def test_joinable_queue_across_processes():
    ctx = mp.get_context("fork")
    q, results = ctx.JoinableQueue(), ctx.Queue()
    procs = [ctx.Process(target=workers.joinable_worker, args=(q, results)) for _ in range(2)]
    for p in procs:
        p.start()
    q.put_many(range(10))
    assert q.join(timeout=T)
    assert sorted(results.get(timeout=T) for _ in range(10)) == [i * 2 for i in range(10)]
    q.put_many([None, None])
    for p in procs:
        p.join(T)
    assert q.join(timeout=T)


def test_simple_queue_ends_are_connection_like():
    q = SimpleQueue()
    reader, writer = q._reader, q._writer
    assert reader.readable and not reader.writable and writer.writable
    assert not reader.closed and not writer.closed and reader.fileno() >= 0
    writer.send(3)
    assert multiprocessing.connection.wait([reader], timeout=T) == [reader] and reader.poll()
    assert reader.recv() == 3 and not reader.poll(0.01)
    q.close()
    assert reader.closed and writer.closed  # CPython's TestSimpleQueue.test_closed
    with pytest.raises(OSError, match="closed"):
        reader.fileno()
    with pytest.raises(OSError, match="closed"):
        reader.poll()


def test_simple_queue_api_and_doorbell():
    q = SimpleQueue()
    assert q.empty()
    ready = multiprocessing.connection.wait([q._reader], timeout=0.05)
    assert ready == []
    q.put({"a": 1})
    assert multiprocessing.connection.wait([q._reader], timeout=T) == [q._reader]
    assert q._reader.poll() and not q.empty()
    assert q._reader.recv() == {"a": 1}
    assert multiprocessing.connection.wait([q._reader], timeout=0.05) == []
    q._writer.send(5)
    assert q.get() == 5
    q.close()
    with pytest.raises(ValueError):
        q.get()


def test_reader_recv_under_rlock_never_waits_for_an_item_a_worker_took():
    """Pool.terminate() drains the task queue holding _rlock: poll() then recv(). A worker
    may take the item in between; recv() must then return, not wait for ever."""
    q = SimpleQueue()
    q._rlock.acquire()
    try:
        assert q._reader.recv() is None  # empty: returns at once
        q.put(1)
        assert q._reader.recv() == 1
    finally:
        q._rlock.release()
    q.put(2)
    assert q._reader.recv() == 2  # without the lock: a blocking get, as before
    q.close()


def test_simple_queue_doorbell_is_off_until_someone_watches_the_pipe():
    """Plain put/get skip the pipe; the first fileno() arms it for every process and rings
    for the items already queued, so wait() never misses them."""
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()
    p = ctx.Process(target=workers.put_simple, args=(q, 0, 3))
    p.start()
    p.join(T)
    assert p.exitcode == 0 and q._ring.qsize() == 3
    assert not select.select([q._doorbell[0]], [], [], 0)[0]  # off: no byte was written
    assert multiprocessing.connection.wait([q._reader], timeout=T) == [q._reader]
    assert [q.get() for _ in range(3)] == [(0, 0), (0, 1), (0, 2)]
    assert not select.select([q._doorbell[0]], [], [], 0)[0]  # drained by the gets: on
    p = ctx.Process(target=workers.put_simple, args=(q, 1, 1))  # armed in the child too
    p.start()
    p.join(T)
    assert select.select([q._doorbell[0]], [], [], T)[0]
    assert q.get() == (1, 0)
    q.close()


def test_simple_queue_doorbell_never_misses_an_item_from_other_processes():
    """connection.wait() on _reader (what ProcessPoolExecutor's manager thread does) wakes for
    every item put by any process: a lost ring would stall this loop."""
    ctx = mp.get_context("fork")
    sq = ctx.SimpleQueue()
    producers = [ctx.Process(target=workers.put_simple, args=(sq, i, 3000)) for i in range(3)]
    for p in producers:
        p.start()
    got = 0
    while got < 9000:
        assert multiprocessing.connection.wait([sq._reader], timeout=10) == [sq._reader], got
        sq._reader.recv()
        got += 1
    for p in producers:
        p.join(T)
    assert not sq._reader.poll()


def test_round_trip_through_child_processes(start_method):
    ctx = mp.get_context(start_method)
    q_in, q_out = ctx.Queue(), ctx.SimpleQueue()
    p = ctx.Process(target=workers.echo_simple, args=(q_in, q_out, 3))
    p.start()
    items = [1, ("a", b"b"), torch.arange(4)]
    q_in.put_many(items)
    got = []
    for _ in items:  # the doorbell rings across processes: wait() sees the child's puts
        assert multiprocessing.connection.wait([q_out._reader], timeout=T) == [q_out._reader]
        got.append(q_out._reader.recv())
    p.join(T)
    assert p.exitcode == 0
    assert got[:2] == items[:2] and torch.equal(got[2], items[2])


def test_many_producers_and_consumers_lose_and_duplicate_nothing():
    """10^5 items, 4 producers (2 one by one, 2 in batches) to 3 consumers (1 in batches)."""
    ctx = mp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue(max_bytes=64 << 20)
    counts = [25_000] * 4
    producers = [ctx.Process(target=workers.produce_sequence, args=(q, i, n, 64 if i >= 2 else 0))
                 for i, n in enumerate(counts)]
    consumers = [ctx.Process(target=workers.consume_until_none, args=(q, out, 32 if i == 0 else 0))
                 for i in range(3)]
    for p in producers + consumers:
        p.start()
    for p in producers:
        p.join(120)
    q.put_many([None] * 3)
    received = [out.get(timeout=120) for _ in consumers]
    for p in consumers:
        p.join(T)
    everything = [item for got in received for item in got]
    assert len(everything) == sum(counts)
    assert len(set(everything)) == sum(counts)  # no duplicate
    for got in received:  # each consumer saw each producer's items in order
        last = defaultdict(lambda: -1)
        for producer, i in got:
            assert i > last[producer]
            last[producer] = i


def test_tensors_arrays_and_nested_containers_are_zero_copy(start_method):
    ctx = mp.get_context(start_method)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    base = torch.zeros(10)
    item = {"tensor": torch.zeros(3, 3), "view": base[2:5],
            "nested": [torch.ones(4), {"array": np.zeros(100_000, dtype=np.float32)}]}
    p = ctx.Process(target=workers.mutate_received, args=(q_in, q_out))
    p.start()
    q_in.put(item)
    assert q_out.get(timeout=T)[0] == "done"
    # The child wrote into the very memory the parent sees: nothing was copied.
    assert torch.equal(item["tensor"], torch.ones(3, 3))
    assert torch.equal(item["nested"][0], torch.full((4,), 7.0))
    assert torch.equal(base, torch.tensor([0, 0, -1, -1, -1, 0, 0, 0, 0, 0.0]))
    q_in.put("release")
    p.join(T)
    assert p.exitcode == 0
    # The array was not born in shared memory: it was copied once, into a block the child
    # mutated; the parent's own array is untouched (numpy arrays cannot be moved in place).
    assert item["nested"][1]["array"].sum() == 0


def test_a_tensor_never_taken_is_freed_with_the_queue():
    def live_blocks():
        gc.collect()
        return _C.arena_stats()["live_blocks"]

    before = live_blocks()
    q = Queue()
    t = mp.zeros(1000)
    q.put([t, {"again": t}])
    q.put(np.ones(100_000))
    del t
    assert live_blocks() > before  # the frames hold references
    del q
    assert live_blocks() == before


def test_a_put_that_does_not_happen_frees_the_blocks_it_pickled():
    # An ordinary array is copied into a block for the message: a put that times out (or a
    # put_many that does not fit) must drop that block again (Note [Failed puts]).
    def live_blocks():
        gc.collect()
        return _C.arena_stats()["live_blocks"]

    q = Queue(maxsize=1)
    q.put(0)
    before = live_blocks()
    array = np.ones(100_000)
    for _ in range(3):
        with pytest.raises(queue.Full):
            q.put(array, timeout=0.01)
        with pytest.raises(queue.Full):
            q.put_many([{"a": array}], block=False)
    assert live_blocks() == before


def test_items_put_by_exited_children_are_freed_by_the_last_holder():
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=workers.put_tensors_and_exit, args=(q, 5))
    p.start()
    p.join(T)
    assert p.exitcode == 0 and q.qsize() == 5
    assert q._ring.holders == 1  # the child stopped holding at exit
    del q  # the tensors (allocated by the child, in its segments) are released by us


def test_queue_passed_to_a_child_that_closes_it(start_method):
    ctx = mp.get_context(start_method)
    q = ctx.Queue()
    p = ctx.Process(target=workers.put_then_close, args=(q, 3))
    p.start()
    assert [q.get(timeout=T) for _ in range(3)] == [0, 1, 2]
    p.join(T)
    assert p.exitcode == 0
    assert q._ring.holders == 1


def test_a_queue_can_travel_through_a_queue():
    outer, inner = Queue(), Queue()
    outer.put(inner)
    copy = outer.get(timeout=T)
    assert inner._ring.holders == 2
    copy.put("via copy")
    assert inner.get(timeout=T) == "via copy"
    del copy
    gc.collect()
    assert inner._ring.holders == 1


def test_maxsize_bounds_the_count_exactly_while_the_ring_grows():
    q = Queue(maxsize=30)
    item = b"m" * 200_000  # in line (under the out-of-line limit): 30 of them need growth
    for _ in range(30):
        q.put(item, block=False)
    assert q.full() and q._ring.capacity > 4 << 20
    with pytest.raises(queue.Full):
        q.put(item, timeout=0.1)
    assert all(q.get(timeout=T) == item for _ in range(30)) and q.empty()


def _echo_pinned(a, b, cpu, trips):
    os.sched_setaffinity(0, {cpu})
    for _ in range(trips):
        b.put(a.get(timeout=T))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin apart")
def test_spinning_switches_off_when_the_peer_shares_our_cpu():
    """Note [Adaptive spinning]: pinned to one CPU with its peer, a waiter's spin can never
    see the event (the peer cannot run meanwhile), so the waiter learns to sleep at once."""
    ctx = mp.get_context("fork")
    a, b = ctx.Queue(), ctx.Queue()
    cpu = sorted(os.sched_getaffinity(0))[0]
    mask = os.sched_getaffinity(0)
    peer = ctx.Process(target=_echo_pinned, args=(a, b, cpu, 300))
    peer.start()
    os.sched_setaffinity(0, {cpu})
    try:
        assert b._ring.spin_state[0] > 0  # opened with two CPUs usable: may spin
        for i in range(300):
            a.put(i)
            assert b.get(timeout=T) == i
        max_ns, _misses, _skip, off = b._ring.spin_state
        assert off > 4, b._ring.spin_state  # backed off at least once past the first pause
    finally:
        os.sched_setaffinity(0, mask)
        peer.join(T)
    assert peer.exitcode == 0
    a.close()
    b.close()


def _report_spin(q, out):
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    q2 = pickle.loads(pickle.dumps(q))  # opened again, now on one CPU
    out.put((q._ring.spin_state[0], q2._ring.spin_state[0]))


def test_a_process_on_one_cpu_never_spins():
    ctx = mp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_report_spin, args=(q, out))
    p.start()
    inherited, reopened = out.get(timeout=T)
    p.join(T)
    assert reopened == 0
    assert inherited == (q._ring.spin_state[0])  # the fork's copy keeps its parent's view
    q.close()


EXIT_PUT_SCRIPT = """
import torch
from torch.utils.data import DataLoader
import torch_mp_ext as mp

class Numbers:
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.tensor([i])

class Trainer(mp.Process):
    def run(self):
        loader = DataLoader(Numbers(), batch_size=1, num_workers=2,
                            multiprocessing_context=mp.get_context("fork"))
        it = iter(loader)
        for i, _ in enumerate(it):
            if i == 2:
                raise RuntimeError("Loader error")

if __name__ == "__main__":
    p = Trainer()
    p.start()
    p.join(60)
    print(p.exitcode)
"""


@pytest.mark.slow  # a script with a process and a DataLoader: 2-3 s
def test_a_put_from_a_finalizer_after_the_exit_hook_is_dropped_quietly(tmp_path):
    """Issue 36 (torch's ``test_proper_exit``, ``loader_error``): a process whose ``run()``
    raises while a DataLoader iterator lives in the traceback. ``Process._bootstrap`` runs the
    exit hooks (our rings are let go) before it clears the exception; the iterator's
    ``__del__`` then puts its workers' sentinels. That printed "Exception ignored ...
    ValueError: this queue object was closed"; torch's queues print nothing
    (Note [Puts after exit])."""
    script = tmp_path / "exit_put.py"
    script.write_text(EXIT_PUT_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=os.path.dirname(
                             os.path.dirname(mp.__file__))))
    assert out.stdout.strip() == "1", (out.stdout, out.stderr)
    assert "RuntimeError: Loader error" in out.stderr
    assert "Exception ignored" not in out.stderr, out.stderr

