"""Datasets and helpers for tests/test_data.py, importable by spawn and forkserver workers."""

from __future__ import annotations

import dataclasses
import os
import signal

import numpy as np
import torch
from torch.utils.data import Dataset


@dataclasses.dataclass
class Point:
    """A picklable class of our own: stored by the pickle fallback."""

    x: int
    y: float


def sample_items() -> list:
    """One item of every kind a store supports, in that order."""
    return [
        None, True, False, 0, -7, 2**100, 1.5, float("-inf"), -0.0, 3 + 4j,
        "", "path/to/ünïcode/图像.jpg", b"\x00\xffbytes", bytearray(b"mutable"),
        (1, "a", (2.5, None)), [1, [2, [3, []]]], {"path": "a.jpg", "label": 3,
                                                    "boxes": [0.5, 1.0, 2.0, 4.5]},
        {1, 2, 3}, frozenset({"x"}), Point(1, 2.5),
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
        np.arange(10, dtype=np.int16)[::3],  # not contiguous: pickled in band
        np.array(7.0), np.zeros((0, 3)), np.float64(2.5), np.int32(-4),
        {"image": np.full((2, 2), 9, dtype=np.uint8), "label": 1},
        torch.arange(6, dtype=torch.float64).reshape(2, 3),
        torch.tensor([1.5, 2.5], dtype=torch.bfloat16), torch.tensor([True, False]),
        torch.tensor(3), torch.empty(0, 4), torch.arange(12).reshape(3, 4).t(),
        torch.ones(2, requires_grad=True), [list(range(3))] * 2, "x" * 100_000,
    ]


def same(a, b) -> bool:
    """Equal values of the same types, recursively (arrays and tensors elementwise)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
                and torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and a != a:
        return b != b
    if isinstance(a, float):
        return a == b and str(a) == str(b)  # -0.0 stays -0.0
    return a == b


class Records(Dataset):
    """A dataset keeping its samples in a list attribute (the copy-on-read case)."""

    def __init__(self, samples: list, kill_at: int = -1, window: int = 0) -> None:
        self.samples = samples
        self.kill_at = kill_at
        self.window = window  # > 0: sample i is the slice [i, i + window)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        if i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a worker dies mid-epoch
        if self.window:
            return i, self.samples[i:i + self.window]
        return i, self.samples[i]


def as_list(batch: list) -> list:
    """collate_fn: the samples as they are."""
    return batch


def private_dirty_kib() -> int:
    """This process's Private_Dirty (pages it wrote that no other process shares), KiB."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1])
    raise RuntimeError("no Private_Dirty in /proc/self/smaps_rollup")


def read_all_and_report(samples, conn) -> None:
    """Child target: reads every sample as a loader would, sends its Private_Dirty growth."""
    before = private_dirty_kib()
    total = 0
    for i in range(len(samples)):
        total += len(samples[i]["path"])
    conn.send((private_dirty_kib() - before, total))
    conn.close()
