"""DataLoader with torch_mp_ext's contexts: the drop-in gaps of issue 19, with real loaders."""

from __future__ import annotations

import gc
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import torch_mp_ext as mp

METHODS = ["fork", "spawn", "forkserver"]


class Squares(Dataset):
    """Tensors; index 13 raises when ``fail`` is set."""

    def __init__(self, n: int = 64, fail: bool = False) -> None:
        self.n, self.fail = n, fail

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.fail and i == 13:
            raise ValueError("sample 13 is broken")
        return torch.full((4,), float(i * i))


def _loader(method: str, dataset: Dataset, **kwargs) -> DataLoader:
    return DataLoader(dataset, batch_size=4, num_workers=2, timeout=60,
                      multiprocessing_context=mp.get_context(method), **kwargs)


@pytest.fixture
def unraisable(monkeypatch):
    """What Python would print as "Exception ignored in ...", collected instead."""
    seen: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook",
                        lambda u: seen.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    return seen


@pytest.mark.parametrize("method", METHODS)
def test_an_iterator_freed_by_the_cycle_collector_shuts_down_quietly(method, unraisable):
    it = iter(_loader(method, Squares()))
    assert torch.equal(next(it)[1], torch.full((4,), 1.0))
    assert torch.equal(next(it)[0], torch.full((4,), 16.0))  # both workers are up
    workers = list(it._workers)
    cycle = {"it": it}
    cycle["self"] = cycle
    it._test_cycle = cycle  # only the cycle collector can free the iterator now
    del it, cycle
    gc.collect()
    assert unraisable == []
    for w in workers:  # __del__ shut them down through the queues it still could use
        w.join(30)
        assert w.exitcode is not None


@pytest.mark.parametrize("method", METHODS)
def test_a_worker_exception_is_reraised_and_cleanup_is_quiet(method, unraisable):
    loader = _loader(method, Squares(fail=True))
    with pytest.raises(ValueError, match="sample 13 is broken") as info:
        for _ in loader:
            pass
    assert "Caught ValueError in DataLoader worker process" in str(info.value)
    del info, loader
    gc.collect()
    assert unraisable == []


def test_nested_get_context_returns_ours():
    spawn = mp.get_context("spawn")
    for method in METHODS:
        ctx = spawn.get_context(method)
        assert ctx is mp.get_context(method)
        assert type(ctx.Queue()).__module__.startswith("torch_mp_ext.")
    assert spawn.get_context() is spawn
    with pytest.raises(ValueError, match="cannot find context for 'nope'"):
        spawn.get_context("nope")
    # torch's own test_dataloader builds its loaders this way.
    loader = _loader("spawn", Squares(8))
    loader.multiprocessing_context = spawn.get_context("fork")
    assert [b[0, 0].item() for b in loader] == [0.0, 16.0]


class Documents(Dataset):
    """Raw-text samples of 100 KB: a batch of 64 pickles to 6.4 MB of non-tensor data."""

    def __len__(self) -> int:
        return 64 * 8

    def __getitem__(self, i: int) -> str:
        return chr(ord("a") + i % 26) * 100_000


def _documents(method: str) -> DataLoader:
    return DataLoader(Documents(), batch_size=64, num_workers=2, timeout=120,
                      multiprocessing_context=mp.get_context(method))


@pytest.mark.parametrize("method", METHODS)
def test_batches_of_more_than_4_mib_of_text_arrive(method):
    batches = list(_documents(method))
    assert len(batches) == 8
    assert [len(b) for b in batches] == [64] * 8
    assert batches[3][5] == chr(ord("a") + (3 * 64 + 5) % 26) * 100_000


@pytest.mark.parametrize("method", METHODS)
def test_break_with_large_batches_prefetched_shuts_down_promptly(method):
    it = iter(_documents(method))
    next(it)
    deadline = time.monotonic() + 30
    while it._tasks_outstanding and time.monotonic() < deadline:  # let the workers fill up
        if all(w.is_alive() for w in it._workers):
            time.sleep(0.2)
            break
    workers = list(it._workers)
    t0 = time.monotonic()
    del it  # break out of the loop: the iterator shuts its workers down
    gc.collect()
    elapsed = time.monotonic() - t0
    assert all(not w.is_alive() for w in workers)
    # Workers blocked on a full queue took ~10 s here before (stock: 0.25-1.6 s): each
    # reached the loader's 5 s join timeout. Under load one worker may still reach it (5.0 s
    # seen with 4 jobs on 2 CPUs), so the bound is below both reaching it. The ratio to stock
    # is measured in benchmarks/bench_dataloader.py, this bounds a regression.
    assert elapsed < 9.0, f"shutdown took {elapsed:.1f} s"
