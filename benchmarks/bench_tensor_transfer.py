"""Tensor hand-off time: torch_mp_ext vs torch.multiprocessing vs stdlib pickling.

Hand-off time is from just before ``put()`` until the consumer holds the tensor (``get()``
returned); the consumer acknowledges before touching the data, then reads every byte (a
float64 sum) and the producer checks the sum. Each library runs in its own producer/consumer
pair of processes (torch's never imports torch_mp_ext, so torch's reducers are measured);
trials are interleaved across libraries, variants and sizes, one warm-up round is dropped,
and cells are medians. In-process memcpy is the floor.

Variants: *fresh* tensors are ordinary tensors sent for the first time (each library moves
them into shared memory at ``put``); *pre-shared* ones were put there before the clock
started (torch: ``share_memory_()``; torch_mp_ext: born in the arena with ``mp.empty``).

    python benchmarks/bench_tensor_transfer.py [--repeats 15] [--transport simple|queue]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_json
import torch

from torch_mp_ext_demo import handoff

SIZES = {"4KB": 4 << 10, "1MB": 1 << 20, "16MB": 16 << 20, "128MB": 128 << 20}


def targets(results: handoff.Results) -> list[str]:
    """The issue's targets, each with the measured figure and PASS/MISS."""
    med = results.median
    lines = []
    sizes = results.sizes
    flat = med("tmx fd arena-born", sizes[-1]) / med("tmx fd arena-born", sizes[0])
    lines.append(f"arena-born {handoff.human_size(sizes[-1])} / {handoff.human_size(sizes[0])}"
                 f": {flat:.2f}x (target <= 2x) {'PASS' if flat <= 2 else 'MISS'}")
    for n in sizes:
        best_torch = min(med("torch fd pre-shared", n), med("torch fs pre-shared", n))
        r = best_torch / med("tmx fd arena-born", n)
        lines.append(f"{handoff.human_size(n)}: best torch pre-shared / tmx arena-born = "
                     f"{r:.1f}x (target >= 10x) {'PASS' if r >= 10 else 'MISS'}")
    for n in sizes:
        if n < 16 << 20:
            continue
        best_torch = min(med("torch fd fresh", n), med("torch fs fresh", n))
        r = best_torch / med("tmx fd fresh", n)
        lines.append(f"{handoff.human_size(n)}: best torch fresh / tmx fresh = {r:.1f}x "
                     f"(target >= 3x) {'PASS' if r >= 3 else 'MISS'}")
    return lines


def write_json(args: argparse.Namespace, results: handoff.Results) -> None:
    rows = [{"series": "memcpy floor", "floor": True, "nbytes": n, "median_s": s}
            for n, s in results.memcpy.items()]
    for v in results.variants:
        for n in results.sizes:
            samples = results.seconds[(v.label, n)]
            rows.append({"series": v.label, "library": v.lib, "variant": v.variant,
                         "strategy": v.strategy, "nbytes": n,
                         "median_s": results.median(v.label, n), "samples_s": samples})
    bench_json.write(args.json, "bench_tensor_transfer", rows,
                     params={"repeats": args.repeats, "warmups": args.warmups,
                             "transport": args.transport, "sizes": results.sizes,
                             "failures": results.failures},
                     rows_doc="hand-off seconds per series (library, variant, strategy) and "
                              "size; floor rows are lower bounds (in-process memcpy)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sizes", default=",".join(SIZES), help="from " + ",".join(SIZES))
    parser.add_argument("--warmups", type=int, default=2,
                        help="untimed 4 KB hand-offs before each trial (Note [Warm hand-offs] "
                             "in torch_mp_ext_demo/handoff_worker.py); 0 measures cold caches")
    parser.add_argument("--transport", choices=["simple", "queue"], default="simple",
                        help="simple: each library's SimpleQueue (a pipe, pickled in the "
                             "caller's thread); queue: each library's Queue")
    bench_json.add_argument(parser)
    args = parser.parse_args()
    sizes = [SIZES[s] for s in args.sizes.split(",")]
    print(f"Tensor hand-off, put() until the consumer holds it: median of {args.repeats} "
          f"(transport: {args.transport}, {args.warmups} warm-up hand-offs per trial)")
    print(f"Python {platform.python_version()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {platform.machine()}")
    results = handoff.run_handoff(sizes, args.repeats, transport=args.transport,
                                   warmups=args.warmups,
                                   progress=lambda i, n: print(f"round {i}/{n}",
                                                               file=sys.stderr, flush=True))
    print()
    print(handoff.format_table(results))
    print()
    if args.json:
        write_json(args, results)
    if results.failures:
        print(f"WRONG DATA: {results.failures}")
        return 1
    if {"4KB", "128MB"} <= set(args.sizes.split(",")):
        for line in targets(results):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
