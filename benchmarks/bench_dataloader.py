"""DataLoader throughput and memory with torch_mp_ext's context vs the default, in one run.

``torch.utils.data.DataLoader(..., multiprocessing_context=torch_mp_ext.get_context(m))``
moves every batch through torch_mp_ext's queues, and its workers stack ``default_collate``'s
batches into recycled arena blocks (Note [Batches born in the arena] in
``torch_mp_ext/processes/dataloader.py``) instead of a fresh torch segment per batch.

Rows (issue 16): (a) 3x32x32 float32 samples, batch 32; (b) 3x224x224 uint8 and float32
samples, batch 64 (10 MB / 38 MB batches); fork and spawn; 2 workers. The main loop reads
every byte of each batch (a byte-wise ``max``: at memory speed whatever the dtype, where a
``sum`` of uint8 costs ~90 ms a batch and would measure torch's reduction instead). Rounds
are interleaved (default, ours, default, ours, ...) and the table reports medians of
batches/s, timed from when every worker has delivered a batch to the last batch (worker
start-up and shutdown are not part of it), plus the peak memory seen while iterating: PSS
summed over the main process and its workers (shared pages counted once), and the growth of
the system's shared memory (``Shmem`` in /proc/meminfo: /dev/shm files and anonymous shared
segments alike; other programs on the machine add noise to it).

The main process runs torch with one intra-op thread, as the workers do (DataLoader sets
that in them): on a machine with few cores, the main process's idle OpenMP threads otherwise
spin after each reduction and take the CPU from the workers (Note [Idle OpenMP threads spin] in
``torch_mp_ext_demo/handoff_worker.py``), which measures the machine's oversubscription, not
the loader. ``--main-threads`` changes it.

``--loader torch_mp_ext`` makes the "ours" column ``torch_mp_ext.DataLoader(...,
max_worker_restarts=N)`` (issue 29: the bookkeeping that lets a dead worker's batches be made
again) instead of torch's class with our context; nothing dies in the benchmark, so its
ratios should match the default ``--loader torch`` run's (the A/B of "no cost when nothing
dies").
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

import bench_json
import torch
from torch.utils.data import DataLoader, Dataset

import torch_mp_ext

ROWS = {
    "a": ("3x32x32 float32", (3, 32, 32), torch.float32, 32),
    "b-uint8": ("3x224x224 uint8", (3, 224, 224), torch.uint8, 64),
    "b-float32": ("3x224x224 float32", (3, 224, 224), torch.float32, 64),
}


class Samples(Dataset):
    """``n`` samples of one shape and dtype, each filled with its index, and a label."""

    def __init__(self, n: int, shape: Tuple[int, ...], dtype: torch.dtype) -> None:
        self.n, self.shape, self.dtype = n, shape, dtype

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
        return torch.full(self.shape, i % 100, dtype=self.dtype), i


def _shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    return 0


class MemorySampler(threading.Thread):
    """Samples PSS of the given processes and the system's Shmem every ``interval`` s."""

    def __init__(self, pids: List[int], interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pids, self.interval = pids, interval
        self.shmem_base = _shmem_kib()
        self.peak_pss = self.peak_shmem = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak_pss = max(self.peak_pss, sum(bench_json.pss_kib(p) for p in self.pids))
            self.peak_shmem = max(self.peak_shmem, _shmem_kib() - self.shmem_base)
            self.stop.wait(self.interval)

    def finish(self) -> Tuple[float, float]:
        self.stop.set()
        self.join()
        return self.peak_pss / 1024, self.peak_shmem / 1024


def run_once(context: str, method: str, row: str, n_batches: int,
             workers: int, restarts: Optional[int] = None) -> Tuple[float, float, float]:
    """(batches/s, peak PSS MiB, peak Shmem growth MiB) of one loader over ``n_batches``;
    ``restarts``: ours is ``torch_mp_ext.DataLoader(max_worker_restarts=restarts)``."""
    _, shape, dtype, batch_size = ROWS[row]
    ctx = (multiprocessing.get_context(method) if context == "default"
           else torch_mp_ext.get_context(method))
    extra = {}
    cls = DataLoader
    if context != "default" and restarts is not None:
        cls, extra = torch_mp_ext.DataLoader, {"max_worker_restarts": restarts}
    loader = cls(Samples(n_batches * batch_size, shape, dtype), batch_size=batch_size,
                 num_workers=workers, multiprocessing_context=ctx, timeout=300, **extra)
    it = iter(loader)
    for _ in range(workers):  # batch i comes from worker i: every worker is up
        next(it)
    sampler = MemorySampler([os.getpid(), *(w.pid for w in it._workers)])
    sampler.start()
    t0 = t_last = time.perf_counter()
    count = 0
    for images, _labels in it:
        images.view(torch.uint8).max()  # the main loop reads every byte of the batch
        count += 1
        t_last = time.perf_counter()  # not the workers' shutdown after the last batch
    elapsed = t_last - t0
    pss, shmem = sampler.finish()
    del it, loader, images, _labels
    if count != n_batches - workers:
        raise RuntimeError(f"expected {n_batches - workers} batches, got {count}")
    return count / elapsed, pss, shmem


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches-a", type=int, default=300, help="batches per run, row (a)")
    parser.add_argument("--batches-b", type=int, default=60, help="batches per run, rows (b)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--methods", default="fork,spawn")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--main-threads", type=int, default=1,
                        help="torch intra-op threads of the main process")
    parser.add_argument("--loader", choices=("torch", "torch_mp_ext"), default="torch",
                        help="the class of the torch_mp_ext column's loader")
    parser.add_argument("--max-worker-restarts", type=int, default=3,
                        help="with --loader torch_mp_ext")
    bench_json.add_argument(parser)
    args = parser.parse_args(argv)
    restarts = args.max_worker_restarts if args.loader == "torch_mp_ext" else None
    torch.set_num_threads(args.main_threads)
    methods, rows = args.methods.split(","), args.rows.split(",")
    results: Dict[tuple, List[Tuple[float, float, float]]] = {}
    for _ in range(args.rounds):
        for row in rows:
            n = args.batches_a if row == "a" else args.batches_b
            for method in methods:
                for context in ("default", "torch_mp_ext"):
                    results.setdefault((row, method, context), []).append(
                        run_once(context, method, row, n, args.workers, restarts))
    print("| samples, batch | start | default batches/s | torch_mp_ext batches/s | ratio "
          "| peak PSS default / ours | peak shmem default / ours |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        label, _, _, batch_size = ROWS[row]
        for method in methods:
            base, ours = results[(row, method, "default")], results[(row, method, "torch_mp_ext")]
            b_rate = statistics.median(r[0] for r in base)
            o_rate = statistics.median(r[0] for r in ours)
            print(f"| ({row}) {label}, {batch_size} | {method} | {b_rate:.0f} | {o_rate:.0f} "
                  f"| {o_rate / b_rate:.2f}x "
                  f"| {max(r[1] for r in base):.0f} / {max(r[1] for r in ours):.0f} MiB "
                  f"| {max(r[2] for r in base):.0f} / {max(r[2] for r in ours):.0f} MiB |")
    print()
    print(f"DataLoader, {args.workers} workers, prefetch_factor 2, main loop reads each batch "
          f"({args.main_threads} main thread(s)); ours: {args.loader}'s DataLoader"
          + (f" (max_worker_restarts={restarts})" if restarts is not None else "")
          + f"; median of {args.rounds} interleaved rounds "
          f"({args.batches_a} batches per run for (a), {args.batches_b} for (b)); peaks are "
          f"the maxima over rounds; torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        bench_json.write(args.json, "bench_dataloader", [
            {"series": context, "start_method": f"({row}) {method}", "row": row,
             "median_batches_per_s": statistics.median(r[0] for r in runs),
             "samples_batches_per_s": [r[0] for r in runs],
             "peak_pss_mib": max(r[1] for r in runs), "peak_shmem_mib": max(r[2] for r in runs)}
            for (row, method, context), runs in results.items()
        ], params=vars(args), rows_doc="DataLoader batches/s per row, start method and context")
    return 0


if __name__ == "__main__":
    sys.exit(main())
