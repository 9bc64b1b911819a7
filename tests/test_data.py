"""torch_mp_ext.data: SharedList, SharedDict and share_dataset (issue 28), with real
DataLoader workers under every start method, a worker SIGKILLed mid-epoch, and /dev/shm."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import shutil
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from _data_workers import Point, Records, as_list, read_all_and_report, same, sample_items
from torch.utils.data import DataLoader, Dataset

import torch_mp_ext as mp
from torch_mp_ext.data import SharedDict, SharedList, share_dataset

METHODS = ["fork", "spawn", "forkserver"]


def _loader(method: str, dataset: Dataset, timeout: float = 60, **kwargs) -> DataLoader:
    return DataLoader(dataset, batch_size=4, num_workers=2, timeout=timeout,
                      collate_fn=as_list, multiprocessing_context=mp.get_context(method),
                      **kwargs)


def test_every_supported_type_reads_back_the_same():
    items = sample_items()
    shared = SharedList(items)
    assert len(shared) == len(items)
    for i, (got, want) in enumerate(zip(shared, items)):
        assert same(got, want), (i, got, want)
    assert all(same(shared[i], items[i]) for i in range(len(items)))


def _growth_of_a_forked_reader(samples) -> tuple[int, int]:
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe(duplex=False)
    p = ctx.Process(target=read_all_and_report, args=(samples, there))
    p.start()
    there.close()
    try:
        assert here.poll(60), "the reader sent nothing"
        return here.recv()
    finally:
        here.close()
        p.join(30)


def test_a_forked_reader_copies_no_page_of_the_store():
    records = [{"path": f"/data/{i}.jpg", "label": i} for i in range(100_000)]
    copied_list, total = _growth_of_a_forked_reader(records)
    shared = SharedList(records)
    del records
    copied_store, total_again = _growth_of_a_forked_reader(shared)
    assert total_again == total
    # Reading the list wrote the refcount of every dict: its pages were copied (copy-on-read)
    assert copied_list > 4 * 1024, copied_list
    assert copied_store < copied_list / 8, (copied_store, copied_list)


def test_arrays_and_tensors_are_views_of_the_store():
    shared = SharedList([np.arange(1000, dtype=np.float64), torch.arange(1000)])
    arr, t = shared[0], shared[1]
    assert mp.is_shared(arr) and not arr.flags.writeable  # read-only view
    assert mp.is_shared(t) and t.data_ptr() % 64 == 0
    assert arr.ctypes.data % 64 == 0


def test_indexing_slicing_and_the_sequence_methods_match_a_list():
    items = [{"i": i, "name": f"n{i}"} for i in range(50)] + ["tail", None]
    shared = SharedList(items)
    assert shared[0] == items[0] and shared[-1] is None and shared[-3] == items[-3]
    assert shared[np.int64(7)] == items[7]
    for s in (slice(None), slice(3, 9), slice(-5, None), slice(None, None, -3),
              slice(40, 2, -7), slice(100, 200)):
        assert shared[s] == items[s]
    assert list(reversed(shared)) == items[::-1]
    assert {"i": 4, "name": "n4"} in shared and "nope" not in shared
    assert shared.index("tail") == 50 and shared.count(None) == 1
    assert shared == items and items == shared and shared != items[:-1]
    with pytest.raises(IndexError):
        shared[52]
    with pytest.raises(IndexError):
        shared[-53]
    with pytest.raises(TypeError, match="indices must be integers"):
        shared["0"]
    with pytest.raises(TypeError, match="does not support item assignment"):
        shared[0] = 1
    assert len(SharedList()) == 0 and list(SharedList(iter(range(3)))) == [0, 1, 2]
    assert copy.deepcopy(shared) is shared and "52 items" in repr(shared)


def test_shared_dict_looks_up_like_a_dict():
    source = {"cat": 0, "dog": 1, 7: "seven", 2.5: [1, 2], None: "none", (1, "a"): b"t",
              b"raw": {"nested": True}, -(2**70): "big"}
    shared = SharedDict(source)
    assert len(shared) == len(source) and list(shared) == list(source)
    assert list(shared.items()) == list(source.items())
    assert list(shared.values()) == list(source.values())
    for key, value in source.items():
        assert shared[key] == value and key in shared
    assert shared[7.0] == "seven" and shared[np.int64(7)] == "seven"  # 7 == 7.0, as in a dict
    assert shared.get("cow", "x") == "x" and "cow" not in shared and 3 not in shared
    with pytest.raises(KeyError):
        shared["cow"]
    with pytest.raises(TypeError, match="unhashable"):
        shared[[1]]
    assert shared == source and SharedDict([("a", 1)]) == {"a": 1}
    big = SharedDict({f"k{i}": i for i in range(5000)})
    assert all(big[f"k{i}"] == i for i in range(0, 5000, 7)) and "k5000" not in big


def test_an_item_that_cannot_be_stored_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"item 2 \(of type builtins.function\)"):
        SharedList([1, 2, lambda: 3])
    with pytest.raises(TypeError, match=r"key 1 \(of type builtins.frozenset\)"):
        SharedDict({"a": 1, frozenset(): 2})
    with pytest.raises(TypeError, match=r"value of entry 0 \(of type _thread.lock\)"):
        import threading

        SharedDict({"a": threading.Lock()})


def test_it_pickles_as_a_small_handle_for_workers_and_by_value_otherwise():
    shared = SharedList([{"path": f"/data/{i}.jpg", "label": i} for i in range(20_000)])
    payload = bytes(ForkingPickler.dumps(shared))
    assert len(payload) < 300 < shared.nbytes // 100
    again = pickle.loads(payload)  # what a spawn worker does (takes over the reference)
    assert again == shared and again[19_999]["label"] == 19_999
    by_value = pickle.loads(pickle.dumps(shared))
    assert by_value == shared and by_value._store is not shared._store
    d = SharedDict({"a": Point(1, 2.0)})
    assert pickle.loads(bytes(ForkingPickler.dumps(d)))["a"] == Point(1, 2.0)


def test_a_store_crosses_a_queue_as_a_handle_and_a_dropped_one_gives_its_reference_back():
    shared = SharedList([f"{i}.jpg" for i in range(5000)])
    block = shared._store.block
    assert block.refcount == 1
    q = mp.Queue()
    q.put(shared)
    assert block.refcount == 2  # the handle in flight holds one
    got = q.get(timeout=30)
    # This process's references to one block are one count (Note [Dead holders])
    assert got == shared and got._store is not shared._store and block.refcount == 1
    del got
    q.put(shared)  # never taken: the queue's last holder drops the handle's reference
    assert block.refcount == 2
    q.close()
    q.join_thread()
    del q
    gc.collect()
    assert block.refcount == 1


class Nested(Dataset):
    def __init__(self) -> None:
        self.samples = [(f"img{i}.png", i % 10) for i in range(3000)]
        self.imgs = self.samples  # torchvision's ImageFolder keeps an alias
        self.class_to_idx = {f"c{i}": i for i in range(10)}
        self.cache: list = []
        self.weights = torch.ones(100)
        self.table = np.ones(20_000)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        return self.samples[i]


def test_share_dataset_converts_lists_dicts_tensors_and_arrays_in_place():
    ds = Nested()
    concat = torch.utils.data.ConcatDataset([ds, Records(list(range(2000)))])
    assert share_dataset(concat, min_items=10) is concat
    assert isinstance(ds.samples, SharedList) and ds.imgs is ds.samples
    assert isinstance(ds.class_to_idx, SharedDict) and ds.class_to_idx["c3"] == 3
    assert ds.cache == [] and type(ds.cache) is list  # smaller than min_items: left alone
    assert mp.is_shared(ds.weights) and mp.is_shared(ds.table)
    assert isinstance(concat.datasets[1].samples, SharedList)
    assert ds[5] == ("img5.png", 5)
    with pytest.raises(TypeError, match=r"Records.samples: cannot store item 1"):
        share_dataset(Records([0, lambda: 0]), attrs=["samples"])
    with pytest.raises(AttributeError, match="no attribute 'labels'"):
        share_dataset(Records([0]), attrs=["labels"])
    with pytest.raises(TypeError, match="needs an object with attributes"):
        share_dataset([1, 2, 3])


def test_a_big_store_goes_back_to_the_os_when_dropped():
    before = mp.memory_stats()["reserved_bytes"]
    shared = SharedList(["x" * 100] * 170_000)
    assert shared.nbytes >= 16 << 20 and shared[-1] == "x" * 100
    assert mp.memory_stats()["reserved_bytes"] >= before + shared.nbytes
    del shared
    gc.collect()
    assert mp.memory_stats()["reserved_bytes"] <= before  # not kept in the arena's cache


def test_building_shows_progress_when_asked(capsys):
    SharedList(range(300), progress=True)
    assert "sharing list: 300/300 (100%) items" in capsys.readouterr().err
    SharedList(range(300))  # not a terminal: quiet
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("method", METHODS)
def test_workers_read_the_same_items_in_any_order_and_slices(method):
    items = sample_items()
    loader = _loader(method, Records(SharedList(items), window=3), shuffle=True)
    seen = {}
    for batch in loader:
        seen.update(batch)
    assert sorted(seen) == list(range(len(items)))
    for i in range(len(items)):
        assert same(seen[i], items[i:i + 3]), (i, seen[i], items[i:i + 3])


@pytest.mark.parametrize("method", [
    "fork", "spawn", pytest.param("forkserver", marks=pytest.mark.slow)])
def test_a_store_outlives_a_worker_killed_mid_epoch(method):
    shared = SharedList([{"path": f"{i}.jpg", "label": i} for i in range(64)])
    # A forkserver worker is not our child (no SIGCHLD): the loader sees the death when its
    # wait for the dead worker's batch times out (the others' deaths interrupt the wait).
    loader = _loader(method, Records(shared, kill_at=21),
                     timeout=15 if method == "forkserver" else 60)
    with pytest.raises(RuntimeError, match="killed by signal|exited unexpectedly"):
        for _ in loader:
            pass
    del loader
    assert [s["label"] for s in shared] == list(range(64))  # still readable here
    seen = {}
    for batch in _loader(method, Records(shared)):  # and in new workers
        seen.update(batch)
    assert [seen[i]["label"] for i in range(64)] == list(range(64))


def _names() -> set[str]:
    prefix = f"torch_{os.getpid()}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def test_nothing_is_left_in_dev_shm_once_loader_and_store_are_gone():
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")  # the strategy that names segments in /dev/shm
    try:
        names_before = _names()
        shared = SharedList([f"/data/{i}.jpg" for i in range(10_000)])
        assert _names() - names_before  # its segment has a name
        seen = {}
        for batch in _loader("fork", Records(shared)):
            seen.update(batch)
        assert len(seen) == 10_000
        del shared, seen, batch
        gc.collect()
        mp.empty_cache()
        deadline = time.monotonic() + 10  # exited workers' mappings go within a tick
        while _names() - names_before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _names() - names_before
    finally:
        mp.set_sharing_strategy(before)


FULL_DEV_SHM = """
import os
import torch_mp_ext as mp
from torch_mp_ext.data import SharedList
from torch_mp_ext.errors import SharedMemoryError
mp.set_sharing_strategy("file_system")
try:
    SharedList(["x" * 1000] * 12000)  # 12 MiB into an 8 MiB /dev/shm
except SharedMemoryError as e:
    assert "--shm-size" in str(e), e
    print("refused")
shared = SharedList(["ok"] * 10)  # what fits still works
assert shared[3] == "ok"
del shared
mp.empty_cache()
print(sorted(n for n in os.listdir("/dev/shm") if n.startswith("torch_")))
"""


@pytest.mark.slow  # a fresh interpreter in a mount namespace (3-5 s)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) to mount a private tmpfs on /dev/shm")
def test_a_store_larger_than_dev_shm_is_an_oserror_naming_the_fix(tmp_path):
    script = tmp_path / "full.py"
    script.write_text(FULL_DEV_SHM)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_MP_EXT_SESSION"}
    out = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o size=8m tmpfs /dev/shm && {sys.executable} {script}"],
        capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["refused", "[]"], out.stdout + out.stderr
