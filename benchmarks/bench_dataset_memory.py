"""DataLoader memory with a dataset of Python records: the plain list, the numpy workaround,
and torch_mp_ext's SharedList, side by side in one run (issue 28).

The dataset holds ``--records`` records (default 2,000,000) of the form ``{"path": str,
"label": int, "boxes": [4 floats]}``; ``DataLoader(num_workers=4, batch_size=64,
shuffle=True)`` with the default collate runs one full epoch, under fork and under spawn
(``--no-shuffle``: in order, where each fork worker touches only the pages of its own
batches). Variants:

- ``list``: the records in a Python list (the stock dataset). Reading an item in a worker
  writes its reference count, so under fork the worker copies every page it reads
  (copy-on-read, pytorch/pytorch#13246); under spawn each worker gets its own pickled copy.
- ``numpy``: the usual workaround (ppwwyyxx.com, 2022): each record pickled into one numpy
  byte array plus an array of offsets; ``__getitem__`` unpickles one slice.
- ``shared``: the same list, then ``torch_mp_ext.data.share_dataset(dataset)``: the one-line
  fix (the list is converted to a ``SharedList``, and the list itself freed).
- ``list+tmx``: the plain list, with torch_mp_ext imported (which makes every ForkingPickler
  send tensors through its arena, the batches too): how much of ``shared``'s difference is
  the dataset, and how much the batches' transport.
- ``idle``: 1,000 records in a list: the fixed cost of the main process and 4 workers;
  ``idle+tmx`` the same with torch_mp_ext imported (and so imported by spawn workers), the
  fixed cost the ``shared`` and ``list+tmx`` runs are compared with.

Each run is a fresh interpreter (the stock variants never import torch_mp_ext, whose
reducers would otherwise apply to their pickles), started one after another, variants
interleaved over ``--rounds``. Reported per run: PSS summed over the main process and its
workers (``/proc/PID/smaps_rollup``; shared pages counted once) when the last batch has
arrived, and its peak (sampled every 0.2 s); the dataset's own size (growth of the main
process's PSS while building it; for ``shared``, the store's bytes); samples/s from the
first batch to the last; and the time from ``iter(loader)`` to the first batch (start-up:
under spawn it includes pickling the dataset for every worker). The growth factor is (PSS
at the end - the matching idle run's PSS) / the dataset's size: 1.0 means the dataset is in
memory once.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import bench_json
from bench_json import pss_kib

VARIANTS = ["list", "numpy", "shared", "list+tmx", "idle", "idle+tmx"]
#: The idle run whose PSS is the fixed cost of each variant.
IDLE = {"list": "idle", "numpy": "idle", "shared": "idle+tmx", "list+tmx": "idle+tmx"}


def record(i: int) -> dict:
    """Record ``i`` of the dataset (deterministic, so every run builds the same one)."""
    return {
        "path": f"/datasets/imagenet/train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG",
        "label": i % 1000,
        "boxes": [float(i % 7), 0.25 * (i % 13), 100.0 + i % 17, 50.5 + i % 19],
    }


# ---- one run, in a fresh interpreter ------------------------------------------------------

class ListDataset:
    """The stock dataset: records in a Python list."""

    def __init__(self, n: int) -> None:
        self.records = [record(i) for i in range(n)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        return self.records[i]


class NumpyDataset:
    """The workaround: pickled records in one numpy byte array, plus offsets."""

    def __init__(self, n: int) -> None:
        import numpy as np

        blobs = [pickle.dumps(record(i), protocol=pickle.HIGHEST_PROTOCOL) for i in range(n)]
        self.offsets = np.cumsum([0] + [len(b) for b in blobs], dtype=np.int64)
        self.data = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        del blobs

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict:
        return pickle.loads(self.data[self.offsets[i]:self.offsets[i + 1]].tobytes())


class Sampler(threading.Thread):
    def __init__(self, pids: List[int]) -> None:
        super().__init__(daemon=True)
        self.pids, self.peak = pids, 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, sum(pss_kib(p) for p in self.pids))
            self.stop.wait(0.2)


def child(variant: str, method: str, n: int, workers: int, batch_size: int,
          shuffle: bool) -> Dict[str, Any]:
    """One epoch of one variant; the measurements as a dict."""
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    if variant.endswith("+tmx"):
        import torch_mp_ext  # its reducers apply to every ForkingPickler
    me = os.getpid()
    before = pss_kib(me)
    t0 = time.perf_counter()
    if variant == "numpy":
        ds: Any = NumpyDataset(n)
    else:
        ds = ListDataset(1000 if variant.startswith("idle") else n)
    build_s = time.perf_counter() - t0
    dataset_kib = pss_kib(me) - before
    share_s = 0.0
    if variant in ("shared", "idle+tmx"):
        import torch_mp_ext.data

        t0 = time.perf_counter()
        torch_mp_ext.data.share_dataset(ds, progress=False)
        share_s = time.perf_counter() - t0
        dataset_kib = ds.records.nbytes // 1024
    loader = DataLoader(ds, batch_size=batch_size, num_workers=workers, timeout=600,
                        shuffle=shuffle,
                        multiprocessing_context=multiprocessing.get_context(method))
    batches = len(loader)
    t_start = time.perf_counter()
    it = iter(loader)
    next(it)
    t_first = time.perf_counter()
    sampler = Sampler([me, *(w.pid for w in it._workers)])
    sampler.start()
    for _ in range(batches - 2):
        next(it)
    last = next(it)  # the last batch: every worker is still alive
    t_last = time.perf_counter()
    end_kib = sum(pss_kib(p) for p in sampler.pids)
    sampler.stop.set()
    sampler.join()
    if len(last["label"]) != (len(ds) - 1) % batch_size + 1:
        raise RuntimeError("the epoch did not end on the last batch")
    try:
        next(it)
    except StopIteration:
        pass
    else:
        raise RuntimeError("the epoch went on past its last batch")
    del it, loader, last
    return {
        "variant": variant, "method": method, "records": len(ds), "build_s": build_s,
        "share_s": share_s, "dataset_mib": dataset_kib / 1024, "end_pss_mib": end_kib / 1024,
        "peak_pss_mib": max(sampler.peak, end_kib) / 1024, "first_batch_s": t_first - t_start,
        "samples_per_s": (len(ds) - batch_size) / max(t_last - t_first, 1e-9),
    }


# ---- the side-by-side run -----------------------------------------------------------------

def run(variant: str, method: str, args: argparse.Namespace) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, method,
           "--records", str(args.records), "--workers", str(args.workers),
           "--batch-size", str(args.batch_size)] + ([] if args.shuffle else ["--no-shuffle"])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=args.timeout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-shuffle", dest="shuffle", action="store_false",
                        help="read the records in order (default: shuffle=True)")
    parser.add_argument("--methods", default="fork,spawn")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "METHOD"), help=argparse.SUPPRESS)
    bench_json.add_argument(parser)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.records, args.workers, args.batch_size,
                               args.shuffle)))
        return 0
    methods, variants = args.methods.split(","), args.variants.split(",")
    results: Dict[tuple, List[Dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for method in methods:
            for variant in variants:
                results.setdefault((variant, method), []).append(run(variant, method, args))

    def med(variant: str, method: str, key: str) -> float:
        return statistics.median(r[key] for r in results.get((variant, method), [{key: 0.0}]))

    print("| dataset | start | dataset MiB | PSS at end / peak (MiB) | growth factor "
          "| samples/s | vs list | start to first batch (s) | vs list |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method in methods:
        base_rate = med("list", method, "samples_per_s")
        base_first = med("list", method, "first_batch_s")
        for variant in variants:
            if variant.startswith("idle") or (variant, method) not in results:
                continue
            idle = med(IDLE[variant], method, "end_pss_mib")
            size = med(variant, method, "dataset_mib")
            end, peak = med(variant, method, "end_pss_mib"), med(variant, method, "peak_pss_mib")
            rate, first = med(variant, method, "samples_per_s"), med(variant, method,
                                                                      "first_batch_s")
            factor = (end - idle) / size if size > 0 else float("nan")
            print(f"| {variant} | {method} | {size:.0f} | {end:.0f} / {peak:.0f} | {factor:.2f}x "
                  f"| {rate:.0f} | {rate / base_rate if base_rate else 0:.2f}x | {first:.2f} "
                  f"| {base_first / first if first else 0:.1f}x faster |")
    print()
    shared_build = [r["share_s"] for runs in results.values() for r in runs if r["share_s"]]
    print(f"{args.records:,} records, DataLoader(num_workers={args.workers}, "
          f"batch_size={args.batch_size}, shuffle={args.shuffle}), default collate, one "
          f"epoch; fixed cost of the main "
          f"process and {args.workers} idle workers (idle / idle+tmx runs): "
          + ", ".join(f"{m} {med('idle', m, 'end_pss_mib'):.0f} / "
                      f"{med('idle+tmx', m, 'end_pss_mib'):.0f} MiB" for m in methods)
          + (f"; share_dataset took {statistics.median(shared_build):.1f} s" if shared_build
             else "")
          + f"; median of {args.rounds} round(s); {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f} at the end")
    if args.json:
        import numpy  # noqa: F401  (the runs are over: imported for the versions recorded)
        import torch  # noqa: F401

        import torch_mp_ext  # noqa: F401

        bench_json.write(args.json, "bench_dataset_memory", [
            dict(runs[-1], series=variant, start_method=method,
                 median_end_pss_mib=med(variant, method, "end_pss_mib"),
                 median_samples_per_s=med(variant, method, "samples_per_s"),
                 median_first_batch_s=med(variant, method, "first_batch_s"))
            for (variant, method), runs in results.items()
        ], params={k: v for k, v in vars(args).items() if k != "child"},
            rows_doc="PSS of main + workers at the end of one epoch, per dataset and start method")
    return 0


if __name__ == "__main__":
    sys.exit(main())
