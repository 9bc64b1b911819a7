"""Datasets for tests/test_loader_restarts.py: importable by spawn and forkserver workers."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import time

import torch
from torch.utils.data import Dataset


def _first_time(flag: str | None) -> bool:
    """True once per flag file: the first worker to get here creates it."""
    if flag is None:
        return False
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _bus_error_on_full_dev_shm() -> None:
    """Writes a sparse /dev/shm file page by page past what the tmpfs holds: SIGBUS. The
    file stays (a full /dev/shm, as in a container): only call it on a private tmpfs."""
    fd = os.open(f"/dev/shm/tmx-loader-test-{os.getpid()}", os.O_CREAT | os.O_RDWR, 0o600)
    size = 64 << 20
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size)
    for offset in range(0, size, mmap.PAGESIZE):
        m[offset] = 1


class Numbers(Dataset):
    """Sample ``i`` is ``[i, i * i]``; sample ``at`` misbehaves (``how``) the first time any
    worker reaches it (the first to create the file ``flag``), or every time (``every_time``;
    for ``how="oom"``, ``flag`` is the cgroup to move into)."""

    def __init__(self, n: int = 48, at: int = -1, how: str = "", flag: str | None = None,
                 every_time: bool = False) -> None:
        self.n, self.at, self.how, self.flag, self.every_time = n, at, how, flag, every_time

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.at and (self.every_time or _first_time(self.flag)):
            if self.how == "hang":
                time.sleep(3600)  # stopped by the loader's timeout
            elif self.how == "segv":
                ctypes.string_at(0)
            elif self.how == "bus":
                _bus_error_on_full_dev_shm()
            elif self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.how == "exit":
                os._exit(3)
            elif self.how == "oom":  # flag: a memory-limited cgroup (v1) to move into
                with open(os.path.join(self.flag, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
                hog = [bytearray(16 << 20) for _ in range(64)]  # touched: zero-filled
                del hog
        return torch.tensor([i, i * i], dtype=torch.float64)


def sleep_the_first_time(flag, seconds):
    """A TaskPool task: the first attempt (flag[1] == 0) publishes its pid in flag[0] and
    sleeps ``seconds`` (to be killed); a later attempt returns at once."""
    if flag[1] == 0:
        flag[1] = 1
        flag[0] = os.getpid()
        time.sleep(seconds)
    return "done"


def crash_in_native_code():
    """A TaskPool task that segfaults (a ctypes read of address 0)."""
    ctypes.string_at(0)


def crash_on(x, bad=3):
    """A per-item pipeline stage that segfaults on item ``bad``."""
    if x == bad:
        ctypes.string_at(0)
    return x
