"""DataLoader batches born in arena blocks (issue 16): same batches and errors as torch's.

Every loader here uses a seeded generator, so the workers' seeds (and the random content of
each sample) are the same for the stock DataLoader and ours; the reference batches come from
the stock loader with the standard library's fork context.
"""

from __future__ import annotations

import gc
import inspect
import multiprocessing
import os
import signal
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

import torch_mp_ext as mp
from torch_mp_ext import _C
from torch_mp_ext.processes import dataloader

METHODS = ["fork", "spawn", "forkserver"]
N = 24


class Rich(Dataset):
    """Samples of every kind default_collate handles, some random (the worker's seed)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {
            "image": torch.full((3, 8, 8), float(i)) + torch.rand(3, 8, 8),
            "pixels": torch.full((16,), i % 256, dtype=torch.uint8),
            "label": i,
            "score": float(i) / 2,
            "name": f"sample-{i}",
            "features": np.random.rand(4).astype(np.float32),
            "pair": (torch.tensor([i, -i]), [np.int64(i), torch.zeros(0)]),
        }


class Stream(IterableDataset):
    """An iterable dataset each worker shards by its id."""

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, N, step):
            yield torch.full((2, 3), float(i)) * torch.rand(1), i


def nested_collate(samples: list) -> dict:
    """A custom collate_fn: default_collate's output, tensors stacked in private memory,
    numpy arrays large and small, nested dicts, lists and tuples; and, apart, whether the
    worker was hooked and where default_collate's output landed there, before pickling."""
    stacked = torch.utils.data.default_collate([s[0] for s in samples])
    storage = stacked.untyped_storage()
    labels = [s[1] for s in samples]
    return {
        "stacked": stacked,
        "private": torch.stack([s[0] * 2 for s in samples]),
        "big": np.stack([np.full(20000, i, dtype=np.float32) for i in labels]),
        "small": np.array(labels),
        "nested": [(stacked.sum(), {"labels": torch.tensor(labels)})],
        "worker": (dataloader.installed(), _C.contains(storage.data_ptr(), storage.nbytes())),
    }


def _loader(ctx, dataset=None, **kwargs) -> DataLoader:
    kwargs.setdefault("batch_size", 4)
    return DataLoader(Rich() if dataset is None else dataset, num_workers=2, timeout=60,
                      multiprocessing_context=ctx,
                      generator=torch.Generator().manual_seed(1234), **kwargs)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


def _in_block(t: torch.Tensor) -> bool:
    s = t.untyped_storage()
    return _C.contains(s.data_ptr(), s.nbytes())


# Two loaders cover every case of issue 16 (spawn workers take seconds to start):
# default_collate over a map-style dataset, pin_memory, persistent workers over two epochs and
# a deeper prefetch; a custom collate_fn over an iterable dataset.
CASES = {
    "map": {"pin_memory": True, "persistent_workers": True, "prefetch_factor": 4, "epochs": 2},
    "iterable": {"dataset": Stream(), "batch_size": 5, "collate_fn": nested_collate},
}


def _batches(ctx, epochs: int = 1, **kwargs) -> list:
    with warnings.catch_warnings():  # pin_memory without an accelerator warns, as stock does
        warnings.simplefilter("ignore", UserWarning)
        loader = _loader(ctx, **kwargs)
        out = [list(loader) for _ in range(epochs)]
    del loader
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    """The stock loader's batches for every case (fork: worker seeds do not depend on it)."""
    stock = multiprocessing.get_context("fork")
    ref = {name: _batches(stock, **kwargs) for name, kwargs in CASES.items()}
    # Stock workers are not hooked: default_collate stacks into a torch segment.
    assert [b.pop("worker") for b in ref["iterable"][0]] == [(False, False)] * 6
    return ref


@pytest.mark.parametrize("method", METHODS)
def test_batches_equal_the_stock_loaders(method, reference):
    ctx = mp.get_context(method)
    ours = {name: _batches(ctx, **kwargs) for name, kwargs in CASES.items()}
    # Ours: hooked, and default_collate stacked into a block (Note [Batches born in the
    # arena]): if torch stops calling UntypedStorage._new_shared there, this fails.
    assert [b.pop("worker") for b in ours["iterable"][0]] == [(True, True)] * 6
    assert _equal(ours, reference)
    assert len(ours["map"]) == 2 and len(ours["iterable"][0]) == 6
    # Our batches live in arena blocks in the main process too, not in torch segments.
    first = ours["map"][0][0]
    assert _in_block(first["image"]) and _in_block(first["pixels"])
    assert not first["image"].untyped_storage().is_shared()
    assert _in_block(ours["iterable"][0][0]["stacked"])


def test_stock_loaders_are_untouched():
    before = torch.UntypedStorage._new_shared
    for batch in _loader(multiprocessing.get_context("fork")):
        assert batch["image"].untyped_storage().is_shared()  # torch's own segment
        assert not _in_block(batch["image"])
    assert len(list(_loader(mp.get_context("fork")))) == N // 4  # never patches the main

    assert torch.UntypedStorage._new_shared == before and not dataloader.installed()


def test_the_torch_internals_we_rely_on_exist():
    from torch.utils.data._utils import collate, worker

    assert dataloader.is_worker_loop(worker._worker_loop)
    assert not dataloader.is_worker_loop(worker.get_worker_info)
    params = inspect.signature(torch.UntypedStorage._new_shared).parameters
    assert list(params) == ["size", "device"]
    assert params["device"].kind == inspect.Parameter.KEYWORD_ONLY
    assert "_new_shared(" in inspect.getsource(collate.collate_tensor_fn)


class Broken(Rich):
    def __getitem__(self, i: int) -> dict:
        if i == 10:
            raise KeyError("sample 10 is missing")
        return super().__getitem__(i)


# spawn: tests/test_dataloader.py::test_a_worker_exception_is_reraised_and_cleanup_is_quiet
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_worker_exception_gives_torchs_error(method):
    loader = _loader(mp.get_context(method), Broken())
    seen = []
    with pytest.raises(KeyError, match="sample 10 is missing") as info:
        for batch in loader:
            seen.append(batch["label"])
    assert "Caught KeyError in DataLoader worker process" in str(info.value)
    assert [b.tolist() for b in seen] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    del info, loader, seen


@pytest.mark.parametrize("method", [  # forkserver: 5 s (its workers are not our children)
    m if m != "forkserver" else pytest.param(m, marks=pytest.mark.slow) for m in METHODS])
def test_a_killed_worker_gives_torchs_error(method):
    # No loader timeout: torch then checks its workers every 5 s (MP_STATUS_CHECK_INTERVAL).
    loader = DataLoader(Rich(), batch_size=1, num_workers=2,
                        multiprocessing_context=mp.get_context(method))
    it = iter(loader)
    next(it)
    victim = it._workers[0].pid
    deadline = time.monotonic() + 30
    with pytest.raises(RuntimeError, match="DataLoader worker") as info:
        os.kill(victim, signal.SIGKILL)
        while time.monotonic() < deadline:
            time.sleep(0.01)
            next(it)
    # torch's SIGCHLD handler raises "killed by signal" wherever the main thread is; if that is
    # inside the result queue's get, torch re-raises it as "exited unexpectedly" (stock too).
    messages = [str(info.value), str(info.value.__cause__)]
    if method == "forkserver":  # not our child: torch sees no SIGCHLD, only a dead worker
        assert f"DataLoader worker (pid(s) {victim}) exited unexpectedly" in messages[0]
    else:
        assert any(f"DataLoader worker (pid {victim}) is killed by signal: Killed" in m
                   for m in messages), messages
    del info
    del it, loader


@pytest.mark.parametrize("method", METHODS)
def test_nothing_left_after_break_or_deleting_the_loader(method):
    loader = _loader(mp.get_context(method), persistent_workers=True, prefetch_factor=4)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    gc.collect()
    workers = list(loader._iterator._workers)
    del loader, _
    gc.collect()
    deadline = time.monotonic() + 30
    while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(w.is_alive() for w in workers)
    # (the autouse leak check then asserts no /dev/shm entry, fd or process is left)


class Large(Dataset):
    """1 MiB samples: batches of 4 MiB, each in a segment of its own."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((256, 1024), float(i))


def test_epochs_do_not_accumulate_mappings(monkeypatch):
    """Note [Idle mappings of a gone owner]: each epoch's workers exit and retire their
    segments; the main process drops its idle mappings of them instead of keeping them."""
    # Fixed-size queues: a growable ring maps 64 GiB of address space (Note [Ring growth]),
    # which mapped_bytes counts; this test counts batch segments.
    from torch_mp_ext.queues import ring_queue

    monkeypatch.setattr(ring_queue, "MAX_GROW_BYTES", ring_queue.DEFAULT_MAX_BYTES)
    loader = _loader(mp.get_context("fork"), Large())
    mapped = []
    for _ in range(4):
        assert [b[0, 0, 0].item() for b in loader] == [4.0 * i for i in range(8)]
        mapped.append(mp.memory_stats()["mapped_bytes"])
    # One epoch maps at most its 8 batch segments (plus the queues): not 4 epochs' worth.
    assert max(mapped) <= 8 * (4 << 20) + (16 << 20), mapped
    mp.empty_cache()  # drops the last epoch's idle mappings too (its workers are gone)
    assert mp.memory_stats()["mapped_bytes"] < (4 << 20) + (16 << 20), mapped
