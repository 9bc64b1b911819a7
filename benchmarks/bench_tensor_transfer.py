"""Tensor hand-off time: torch_mp_ext vs torch.multiprocessing vs stdlib pickling.

Hand-off time is from just before ``put()`` until the consumer holds the tensor (``get()``
returned); the consumer acknowledges before touching the data, then reads every byte (a
float64 sum) and the producer checks the sum. Each library runs in its own producer/consumer
pair of processes (torch's never imports torch_mp_ext, so torch's reducers are measured);
trials are interleaved across libraries, variants (in a new seeded order each round) and
sizes, one warm-up round is dropped,
and cells are medians. Three floors: in-process memcpy; the Python pipe floor (64 bytes
through ``os.write``/``os.read`` on a pipe, timed and acknowledged like the tensor rows),
to which issue 15's targets relate the arena-born rows; and the tensor floor (the same
pipe carrying where the tensor lies in a mapping both sides share, and ``torch.frombuffer``
there: the least any library's tensor hand-off can take, Note [Tensor floor] in
``torch_mp_ext_demo/handoff_worker.py``).

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
    """Issue 15's targets, each with the measured figure and PASS/MISS."""
    med = results.median
    floor = handoff.FLOOR.label
    lines = []

    def line(text: str, ok: bool) -> None:
        lines.append(f"{text} {'PASS' if ok else 'MISS'}")

    for n in results.sizes:
        size = handoff.human_size(n)
        for s in ("fd", "fs"):
            r = med(f"tmx {s} arena-born", n) / med(floor, n)
            line(f"{size}: tmx {s} arena-born / floor = {r:.1f}x (target <= 3x)", r <= 3)
        for s in ("fd", "fs"):
            r = med(f"tmx {s} arena-born", n) / med(handoff.TENSOR_FLOOR.label, n)
            lines.append(f"{size}: tmx {s} arena-born / tensor floor = {r:.1f}x (no target)")
        r = med("tmx fs arena-born", n) / med("tmx fd arena-born", n)
        line(f"{size}: tmx fs / fd arena-born = {r:.2f}x (target <= 1.3x)", r <= 1.3)
    for n in results.sizes:
        if n not in (4 << 10, 16 << 20):
            continue
        for s in ("fd", "fs"):
            r = med(f"torch {s} pre-shared", n) / med(f"tmx {s} arena-born", n)
            line(f"{handoff.human_size(n)}: torch {s} pre-shared / tmx {s} arena-born = "
                 f"{r:.1f}x (target >= 10x)", r >= 10)
    return lines


def write_json(args: argparse.Namespace, results: handoff.Results) -> None:
    rows = [{"series": "memcpy floor", "floor": True, "nbytes": n, "median_s": s}
            for n, s in results.memcpy.items()]
    for v in results.variants:
        for n in results.sizes:
            samples = results.seconds[(v.label, n)]
            floor = v in (handoff.FLOOR, handoff.TENSOR_FLOOR)
            rows.append({"series": v.label, "floor": floor, "library": v.lib,
                         "variant": v.variant,
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
    if {"4KB", "16MB"} <= set(args.sizes.split(",")):
        for line in targets(results):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
