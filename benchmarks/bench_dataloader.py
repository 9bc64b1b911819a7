"""DataLoader throughput with torch_mp_ext's context vs the default, side by side in one run.

``torch.utils.data.DataLoader(..., multiprocessing_context=torch_mp_ext.get_context(m))``
moves every batch through torch_mp_ext's queues (index queues and the result queue) instead
of multiprocessing's pipes and feeder threads. The dataset makes small samples (a 3x32x32
float tensor, a label, a 64-float numpy array), so the transport, not the work, dominates.
Rounds are interleaved and the table reports medians of batches/s, timed from the first
batch to the last (worker start-up is not part of it).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import bench_json
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import torch_mp_ext


class Samples(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return {"image": torch.full((3, 32, 32), float(i)), "label": i,
                "features": np.full(64, i, dtype=np.float32)}


def batches_per_second(context: Any, method: str, n_batches: int, batch_size: int,
                       workers: int) -> float:
    if context == "default":
        ctx = multiprocessing.get_context(method)
    else:
        ctx = torch_mp_ext.get_context(method)
    loader = DataLoader(Samples(n_batches * batch_size), batch_size=batch_size,
                        num_workers=workers, multiprocessing_context=ctx, timeout=120)
    it = iter(loader)
    next(it)  # workers are up
    t0 = time.perf_counter()
    count = 1
    for _ in it:
        count += 1
    elapsed = time.perf_counter() - t0
    del it
    return (count - 1) / elapsed


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--methods", default="fork,spawn")
    bench_json.add_argument(parser)
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    results: Dict[tuple, List[float]] = {}
    for _ in range(args.rounds):
        for method in methods:
            for context in ("default", "torch_mp_ext"):
                rate = batches_per_second(context, method, args.batches, args.batch_size,
                                          args.workers)
                results.setdefault((method, context), []).append(rate)
    print("| start method | multiprocessing context (default) | torch_mp_ext context | ratio |")
    print("|---|---|---|---|")
    for method in methods:
        base = statistics.median(results[(method, "default")])
        ours = statistics.median(results[(method, "torch_mp_ext")])
        print(f"| {method} | {base:.0f} batches/s | {ours:.0f} batches/s | {ours / base:.2f}x |")
    print()
    print(f"DataLoader, {args.workers} workers, batch {args.batch_size} (3x32x32 float tensor, "
          f"label, 64-float array per sample), {args.batches} batches, median of "
          f"{args.rounds} interleaved rounds; torch {torch.__version__}")
    if args.json:
        bench_json.write(args.json, "bench_dataloader", [
            {"series": context, "start_method": method,
             "median_batches_per_s": statistics.median(rates), "samples_batches_per_s": rates}
            for (method, context), rates in results.items()
        ], params=vars(args), rows_doc="DataLoader batches/s per context and start method")
    return 0


if __name__ == "__main__":
    sys.exit(main())
