"""What letting go of a shared tensor costs its sender, by size, torch_mp_ext vs torch.

The sender makes a shared tensor (torch_mp_ext: born in the arena with ``mp.empty``; torch:
``share_memory_()``), fills it, sends it to a consumer process, which maps it, reads one
element, drops it and says so; then the sender's ``del`` of its last reference is timed.
That ``del`` is where the segment's pages are unmapped (and, for ``file_system``, the name
unlinked): issue 15 asked that it cost the same at 4 KB and 128 MB (Note [Unmapping off the
caller's path] in ``csrc/shm/unmapper.h``). Libraries and sizes are interleaved; medians.

    python benchmarks/bench_release.py [--repeats 9] [--json PATH]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_json
import torch

SIZES = [4 << 10, 1 << 20, 16 << 20, 128 << 20]
SERIES = [("tmx", "file_descriptor"), ("tmx", "file_system"),
          ("torch", "file_descriptor"), ("torch", "file_system")]


def consumer(q, done):
    while True:
        t = q.get()
        if t is None:
            return
        float(t[0])
        del t
        done.put(1)


def side(lib: str, jobs, answers) -> None:
    """One library's sender, in a process of its own (torch's never imports ours)."""
    if lib == "tmx":
        import torch_mp_ext as mp
    else:
        import torch.multiprocessing as mp
    ctx = mp.get_context("fork")
    q, done = ctx.SimpleQueue(), ctx.SimpleQueue()
    peer = ctx.Process(target=consumer, args=(q, done), daemon=True)
    peer.start()
    while True:
        job = jobs.get()
        if job is None:
            break
        strategy, nbytes = job
        mp.set_sharing_strategy(strategy)
        if lib == "tmx":
            t = mp.empty(nbytes // 4)
        else:
            t = torch.empty(nbytes // 4)
            t.share_memory_()
        t.fill_(1.0)
        q.put(t)
        done.get()
        start = time.perf_counter()
        del t
        answers.put(time.perf_counter() - start)
    q.put(None)
    peer.join(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    bench_json.add_argument(parser)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    sides = {}
    for lib in ("tmx", "torch"):
        jobs, answers = ctx.SimpleQueue(), ctx.SimpleQueue()
        proc = ctx.Process(target=side, args=(lib, jobs, answers))
        proc.start()
        sides[lib] = (proc, jobs, answers)
    samples: dict = {}
    for rep in range(-1, args.repeats):  # round -1 warms up and is not counted
        for nbytes in SIZES:
            for lib, strategy in SERIES:
                _, jobs, answers = sides[lib]
                jobs.put((strategy, nbytes))
                seconds = answers.get()
                if rep >= 0:
                    samples.setdefault((lib, strategy, nbytes), []).append(seconds)
    for proc, jobs, _ in sides.values():
        jobs.put(None)
        proc.join(120)
    head = ["size"] + [f"{lib} {strategy}" for lib, strategy in SERIES]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for nbytes in SIZES:
        cells = [f"{statistics.median(samples[(lib, s, nbytes)]) * 1e6:.0f} us"
                 for lib, s in SERIES]
        size = f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"
        print(f"| {size} | " + " | ".join(cells) + " |")
    print(f"\nthe sender's `del` of its last reference, median of {args.repeats}")
    if args.json:
        bench_json.write(args.json, "bench_release", [
            {"series": f"{lib} {s}", "library": lib, "strategy": s, "nbytes": n,
             "median_s": statistics.median(samples[(lib, s, n)]),
             "samples_s": samples[(lib, s, n)]}
            for lib, s in SERIES for n in SIZES],
            params=vars(args), rows_doc="seconds of the sender's final del, per size")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
