"""Start N workers that each run a tiny tensor op, and join them: torch vs torch_mp_ext.

Side by side in one run, interleaved, medians:

- ``torch.mp.spawn``: ``torch.multiprocessing.spawn(fn, nprocs=N)``;
- ``tmx spawn``: ``torch_mp_ext.spawn(fn, nprocs=N)``, the default (fresh interpreters);
- ``tmx forkserver``: ``torch_mp_ext.start_processes(fn, nprocs=N, start_method="forkserver")``,
  the fast path (workers forked from a server with torch imported, started in parallel).

"cold" is the first call in a fresh interpreter (each measured in its own subprocess, after
its imports; for the fast path it includes starting the server), "warm" a repeated call in a
process that has made one already. Ratios are torch's median over ours (higher is faster).

Usage: ``python benchmarks/bench_spawn.py [--repeat R] [--nprocs 2 4]``
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.multiprocessing as torch_mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_json

import torch_mp_ext as tmx

VARIANTS = {
    "torch.mp.spawn": lambda n: torch_mp.spawn(tiny_op, nprocs=n),
    "tmx spawn": lambda n: tmx.spawn(tiny_op, nprocs=n),
    "tmx forkserver": lambda n: tmx.start_processes(tiny_op, nprocs=n, start_method="forkserver"),
}


def tiny_op(i: int) -> None:
    torch.ones(8).add_(i).sum()


def timed(variant: str, nprocs: int) -> float:
    t0 = time.perf_counter()
    VARIANTS[variant](nprocs)
    return time.perf_counter() - t0


def cold(variant: str, nprocs: int) -> float:
    """One first call, in a fresh interpreter."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--cold-one", variant,
                          str(nprocs)], capture_output=True, text=True, timeout=600, check=True)
    return float(out.stdout.split()[-1])


def rotated(items: list[str], k: int) -> list[str]:
    return items[k % len(items):] + items[:k % len(items)]


def measure(nprocs_list: list[int], repeat: int) -> dict[tuple[str, int, str], list[float]]:
    names = list(VARIANTS)
    times: dict[tuple[str, int, str], list[float]] = {}
    for r in range(repeat):  # cold: a fresh subprocess per measurement, interleaved
        for n in nprocs_list:
            for v in rotated(names, r):
                times.setdefault((v, n, "cold"), []).append(cold(v, n))
    for n in nprocs_list:  # warm-up calls (untimed), then interleaved repeats
        for v in names:
            timed(v, n)
    for r in range(repeat):
        for n in nprocs_list:
            for v in rotated(names, r):
                times.setdefault((v, n, "warm"), []).append(timed(v, n))
    return times


def table(times: dict[tuple[str, int, str], list[float]], nprocs_list: list[int],
          repeat: int) -> str:
    names = list(VARIANTS)
    lines = [
        f"Start N workers running a tiny tensor op and join them: median of {repeat}, seconds "
        "(ratio: torch.mp.spawn / this)",
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, {platform.machine()}",
        "",
        "| N | call | " + " | ".join(names) + " |",
        "|---|------|" + "|".join("-" * (len(v) + 2) for v in names) + "|",
    ]
    for n in nprocs_list:
        for call in ("cold", "warm"):
            base = statistics.median(times[("torch.mp.spawn", n, call)])
            cells = []
            for v in names:
                med = statistics.median(times[(v, n, call)])
                ratio = "" if v == "torch.mp.spawn" else f" ({base / med:.1f}x)"
                cells.append(f"{med:.3f}{ratio}")
            lines.append(f"| {n} | {call} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cold-one", nargs=2, metavar=("VARIANT", "N"), help=argparse.SUPPRESS)
    bench_json.add_argument(parser)
    args = parser.parse_args()
    if args.cold_one:
        variant, n = args.cold_one
        print(f"{timed(variant, int(n)):.6f}")
        return
    times = measure(args.nprocs, args.repeat)
    print(table(times, args.nprocs, args.repeat))
    if args.json:
        bench_json.write(args.json, "bench_spawn", [
            {"series": v, "nprocs": n, "call": call, "median_s": statistics.median(ts),
             "samples_s": ts}
            for (v, n, call), ts in times.items()
        ], params={"repeat": args.repeat, "nprocs": args.nprocs},
            rows_doc="seconds to start nprocs workers running a tiny op and join them; "
                     "cold: first call in a fresh interpreter, warm: a repeated call")


if __name__ == "__main__":
    main()
