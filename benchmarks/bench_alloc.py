"""What a fresh allocation costs a sender whose consumer keeps what it received (issue 26).

A producer sends N tensors of 300 KB (past the slab classes: one segment each) to a consumer
that keeps them all, like a replay buffer or a prefetching loader; its pools then hold N
segments, none with a free block. Then fresh 300 KB allocations (``mp.empty``, dropped at
once, sent nowhere) are timed: a pool that runs dry must not pay for the N segments others
hold (Note [Reclaiming off the allocation path] in ``csrc/shm/arena.h``). Rows for N = 20
and N = 1,500, interleaved per round, both strategies; medians, and the ratio of the 1,500
row to the 20 row (the target is at most 2x).

    python benchmarks/bench_alloc.py [--repeats 5] [--allocs 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_json
import torch

NBYTES = 300_000
HELD = [20, 1500]
STRATEGIES = ["file_descriptor", "file_system"]


def keeper(q, ready):
    kept = []
    while True:
        t = q.get()
        if t is None:
            break
        if isinstance(t, str):
            ready.put(len(kept))
            continue
        kept.append(t)
    del kept


def trial(strategy: str, held: int, allocs: int) -> float:
    """Median microseconds of one fresh allocation with `held` segments kept by a consumer,
    measured in a fresh producer process."""
    import torch_mp_ext as mp

    ctx = mp.get_context("fork")
    out = ctx.SimpleQueue()

    def producer():
        mp.set_sharing_strategy(strategy)
        q, ready = ctx.Queue(), ctx.SimpleQueue()
        peer = ctx.Process(target=keeper, args=(q, ready))
        peer.start()
        for _ in range(held):
            q.put(mp.empty(NBYTES, dtype=torch.uint8))
        q.put("sync")
        assert ready.get() == held
        times = []
        for _ in range(allocs):
            start = time.perf_counter()
            t = mp.empty(NBYTES, dtype=torch.uint8)
            times.append(time.perf_counter() - start)
            q.put(t)  # kept too: the pools never have a free block
            del t
        q.put(None)
        peer.join(120)
        out.put(statistics.median(times) * 1e6)

    p = ctx.Process(target=producer)
    p.start()
    result = out.get()
    p.join(120)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--allocs", type=int, default=200)
    bench_json.add_argument(parser)
    args = parser.parse_args()
    cells: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for strategy in STRATEGIES:
            for held in HELD:
                cells.setdefault((strategy, held), []).append(trial(strategy, held, args.allocs))
    rows = []
    print(f"fresh {NBYTES // 1000} KB allocation, median us over {args.repeats} rounds "
          f"of {args.allocs}")
    print(f"| strategy | {HELD[0]} segments held | {HELD[1]} segments held | ratio |")
    print("|---|---|---|---|")
    for strategy in STRATEGIES:
        small = statistics.median(cells[(strategy, HELD[0])])
        large = statistics.median(cells[(strategy, HELD[1])])
        print(f"| {strategy} | {small:.0f} us | {large:.0f} us | {large / small:.2f}x |")
        rows.append({"strategy": strategy, "held_small": HELD[0], "held_large": HELD[1],
                     "us_small": small, "us_large": large, "ratio": large / small})
    if args.json:
        bench_json.write(args.json, "bench_alloc", rows,
                         params={"repeats": args.repeats, "allocs": args.allocs,
                                 "nbytes": NBYTES})


if __name__ == "__main__":
    main()
