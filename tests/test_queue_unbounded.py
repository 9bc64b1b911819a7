"""Issue 14's done-when checks: unbounded queues, items of any size, through every queue,
Pool and DataLoader (Note [Ring growth], Note [Large items out of line])."""

from __future__ import annotations

import os

import _queue_workers as workers
import pytest
from torch.utils.data import DataLoader

import torch_mp_ext as mp
from torch_mp_ext.errors import PeerDiedError

T = 120
#: The big bytes item (issue 14 asks 1 GB: TMX_BIG_ITEM_BYTES=1073741824, run by hand).
BIG = int(os.environ.get("TMX_BIG_ITEM_BYTES", 64 << 20))


def test_200_mb_of_small_items_then_a_consumer_gets_them_in_order():
    ctx = mp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    payload = b"p" * 1000
    n = 200_000  # ~200 MB of 1 KB items, nobody reading: the stdlib's "fill, then start"
    for i in range(n):
        q.put((i, payload))
    assert q.qsize() == n and not q.full()
    consumer = ctx.Process(target=workers.check_in_order, args=(q, n, 1000, out))
    consumer.start()
    assert out.get(timeout=T) is True
    consumer.join(T)
    assert consumer.exitcode == 0 and q.empty()


def _get(q):
    if hasattr(q, "_reader"):  # SimpleQueue.get() has no timeout: wait for the item first
        assert q._reader.poll(T), "no item within the timeout"
        return q.get()
    return q.get(timeout=T)


@pytest.mark.parametrize("kind", ["Queue", "SimpleQueue"])
def test_big_bytes_and_a_20_mb_list_cross_every_queue(kind):
    ctx = mp.get_context("fork")
    q_in, q_out = getattr(ctx, kind)(), getattr(ctx, kind)()
    big = os.urandom(1 << 20) * (BIG >> 20)
    many = list(range(4_000_000))  # pickles to about 20 MB
    for item in (big, many):
        p = ctx.Process(target=workers.echo_through, args=(q_in, q_out))
        p.start()
        q_in.put(item)
        assert _get(q_out) == item
        p.join(T)
        assert p.exitcode == 0


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pool_arguments_results_and_errors_of_any_size(method):
    big = os.urandom(1 << 20) * (BIG >> 20)
    with mp.get_context(method).Pool(2) as pool:
        assert pool.apply(workers.identity, (big,)) == big
        assert pool.map(len, [b"y" * 5_000_000] * 2) == [5_000_000] * 2
        assert pool.apply(workers.identity, (list(range(4_000_000)),))[-1] == 3_999_999
        with pytest.raises(ValueError) as info:  # CPython's test_map_no_failfast: 1 MB message
            pool.map(workers.raise_big_value_error, range(2))
        assert len(str(info.value)) == 1_000_000


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_batches_of_more_than_4_mib_of_strings(method):
    loader = DataLoader(workers.BigStringDataset(), batch_size=64, num_workers=2, timeout=T,
                        multiprocessing_context=mp.get_context(method))
    seen = []
    for batch in loader:
        assert len(batch["s"]) == 64 and all(len(s) == 100_000 for s in batch["s"])
        seen.extend(batch["i"].tolist())
    assert seen == list(range(256))


def test_an_out_of_line_item_of_a_sigkilled_producer_is_lost_cleanly():
    # Note [Large items out of line]: its fd server died with it; the queue goes on.
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=workers.put_big_then_die, args=(q, 1 << 20))
    p.start()
    p.join(T)
    assert p.exitcode == -9 and q.qsize() == 1
    with pytest.raises(PeerDiedError, match="lost"):
        q.get(timeout=T)
    q.put_many([1, b"x" * (1 << 20)])
    assert q.get_many(2, timeout=T) == [1, b"x" * (1 << 20)]
