"""Generator tasks: per-item cost and first-item latency, side by side in one run.

One worker process yields ``n`` values, the parent consumes them in order (reading the value
and checking its first element). Contenders, each with a warm pool of one worker:

- ``torch_mp_ext``: ``TaskPool.submit(gen, num_returns="streaming")``, ``ref.get()`` per item;
  8 MB arrays are ordinary numpy arrays (copied once into the arena, read zero-copy);
- ``torch_mp_ext (arena-born)``: the same generator allocating with ``mp.empty_array``
  (nothing copied at all; 8 MB rows only);
- ``mp.Pool.imap``: ``multiprocessing.Pool(1).imap(make_item, range(n))`` (fork), each item a
  task: pickled through a pipe both ways;
- ``ProcessPoolExecutor``: ``submit(make_list, n)`` returning the list of the same values
  (what one writes without generator tasks): the first item comes with the last;
- ``Ray streaming``: a Ray generator task (``ObjectRefGenerator``, local cluster,
  ``num_cpus=2``), ``ray.get(ref)`` per item, run in a subprocess with the interpreter of
  ``$TMX_BENCH_RAY_PYTHON`` (default ``/work/venv-ray/bin/python``) or this one if it has Ray;
  otherwise its column says why it is missing.

Rounds of the local contenders are interleaved (every contender once per round) and the
table reports medians. Ray's rounds run first, in a phase of their own, and its cluster is
shut down before the others start: its daemons (raylet, GCS) take enough CPU on a small
machine to slow every contender's first item several-fold. Ratios are the contender's
median over torch_mp_ext's: higher means torch_mp_ext is faster.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

BIG = 8 << 20
WORK = 20e-6  # seconds of CPU per item in the first-item rows
TIMEOUT = 300.0


def value(i: int, size: int, work: float = 0.0) -> Any:
    """Item i: the int i, or an array of ``size`` bytes; ``work`` seconds of CPU first."""
    if work:
        end = time.perf_counter() + work
        while time.perf_counter() < end:
            pass
    return i if size == 0 else np.full(size, i % 251, dtype=np.uint8)


def gen_values(n: int, size: int, work: float = 0.0):
    for i in range(n):
        yield value(i, size, work)


def gen_arena_values(n: int, size: int, work: float = 0.0):
    import torch_mp_ext as mp

    for i in range(n):
        arr = mp.empty_array(size, np.uint8)
        arr.fill(i % 251)
        yield arr


def make_item(args: tuple[int, int, float]) -> Any:
    return value(*args)


def make_list(n: int, size: int, work: float = 0.0) -> list[Any]:
    return [value(i, size, work) for i in range(n)]


def check(i: int, v: Any, size: int) -> None:
    first = v if size == 0 else int(v[0])
    if first != (i if size == 0 else i % 251):
        raise AssertionError(f"item {i}: got {first}")


# ---- one measurement: (seconds per item, seconds to the first item) ------------------------


def run_tmx(pool: Any, fn: Callable, n: int, size: int, work: float) -> tuple[float, float]:
    t0 = time.perf_counter()
    gen = pool.submit(fn, n, size, work, num_returns="streaming")
    first = None
    for i in range(n):
        v = gen.next(timeout=TIMEOUT).get(timeout=TIMEOUT)
        if first is None:
            first = time.perf_counter() - t0
        check(i, v, size)
        del v
    return (time.perf_counter() - t0) / n, first


def run_imap(pool: Any, n: int, size: int, work: float) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = None
    for i, v in enumerate(pool.imap(make_item, ((i, size, work) for i in range(n)))):
        if first is None:
            first = time.perf_counter() - t0
        check(i, v, size)
        del v
    return (time.perf_counter() - t0) / n, first


def run_ppe(ex: Any, n: int, size: int, work: float) -> tuple[float, float]:
    t0 = time.perf_counter()
    values = ex.submit(make_list, n, size, work).result(TIMEOUT)
    first = time.perf_counter() - t0
    for i, v in enumerate(values):
        check(i, v, size)
    return (time.perf_counter() - t0) / n, first


# ---- contenders in interpreters that never import torch_mp_ext -----------------------------
# Importing torch_mp_ext registers its numpy reducer with ForkingPickler: a stdlib Pool in
# this process (or forked from it) would send arrays through the arena too. So the stdlib
# and Ray contenders run in child interpreters, driven round by round over a pipe.

_PROTO = "@@"


def child(kind: str) -> None:
    """A child interpreter's command loop: one JSON request per line of stdin."""
    runners: dict[str, Callable[[int, int, float], tuple[float, float]]] = {}
    if kind == "stdlib":
        fork = multiprocessing.get_context("fork")
        mpool = fork.Pool(1)
        ex = concurrent.futures.ProcessPoolExecutor(1, mp_context=fork)
        runners = {"mp.Pool.imap": lambda n, s, w: run_imap(mpool, n, s, w),
                   "ProcessPoolExecutor": lambda n, s, w: run_ppe(ex, n, s, w)}
        version = platform.python_version()
    else:
        import logging

        import ray

        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR,
                 log_to_driver=False)
        gen = ray.remote(num_cpus=1)(gen_values)

        def run_ray(n: int, size: int, work: float) -> tuple[float, float]:
            t0 = time.perf_counter()
            first = None
            for i, ref in enumerate(gen.remote(n, size, work)):
                v = ray.get(ref)
                if first is None:
                    first = time.perf_counter() - t0
                check(i, v, size)
                del v, ref
            return (time.perf_counter() - t0) / n, first

        runners = {"Ray streaming": run_ray}
        version = ray.__version__
    for run in runners.values():  # warm-up: workers started, stores touched
        run(20, 0, 0.0)
        run(2, BIG, 0.0)
    print(_PROTO + json.dumps({"version": version}), flush=True)
    for line in sys.stdin:
        name, n, size, work = json.loads(line)
        print(_PROTO + json.dumps(runners[name](n, size, work)), flush=True)
    if kind == "stdlib":
        mpool.terminate()
        ex.shutdown()


class Child:
    """A contender's interpreter; ``why`` says why it is unavailable."""

    def __init__(self, kind: str, python: str) -> None:
        self.proc: subprocess.Popen | None = None
        self.why = ""
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, PYTHONPATH=here, RAY_AUTH_MODE="disabled",
                   RAY_USAGE_STATS_ENABLED="0")
        self.proc = subprocess.Popen(
            [python, "-c", f"import bench_tasks as b; b.child({kind!r})"], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        reply = self._read()
        self.version = reply["version"] if reply else ""

    def _read(self) -> Any:
        for line in self.proc.stdout:
            if line.startswith(_PROTO):
                return json.loads(line[len(_PROTO):])
        err = self.proc.stderr.read().strip().splitlines() or ["no output"]
        self.why = f"failed to run ({err[-1][:90]})"
        self.proc = None
        return None

    def run(self, name: str, n: int, size: int, work: float) -> tuple[float, float] | None:
        if self.proc is None:
            return None
        self.proc.stdin.write(json.dumps([name, n, size, work]) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        return None if reply is None else tuple(reply)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def ray_python() -> tuple[str | None, str]:
    python = os.environ.get("TMX_BENCH_RAY_PYTHON", "/work/venv-ray/bin/python")
    if os.path.exists(python):
        return python, ""
    try:
        import ray  # noqa: F401

        return sys.executable, ""
    except ImportError:
        return None, f"not installed (no {python}, no ray in this interpreter)"


# ---- the table ------------------------------------------------------------------------------


def fmt(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--small", type=int, default=2000, help="small items per generator")
    parser.add_argument("--big", type=int, default=30, help="8 MB arrays per generator")
    parser.add_argument("--work-items", type=int, default=1000,
                        help="items of the first-item rows (and ten times as many)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray column")
    parser.add_argument("--raw", action="store_true", help="also print every measurement")
    args = parser.parse_args(argv)

    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_mp_ext as mp  # the checkout's, built in place, unless installed

    # (key, n, size, work): per-item cost with no work per item; first-item latency at two
    # generator lengths with WORK seconds of CPU per item (what a real producer does).
    spec = [("small", args.small, 0, 0.0), ("work", args.work_items, 0, WORK),
            ("work x10", args.work_items * 10, 0, WORK), ("big", args.big, BIG, 0.0)]
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}
    python, ray_why = (None, "skipped (--no-ray)") if args.no_ray else ray_python()
    ray_version = ray_why
    if python is not None:  # Ray first, alone: see the module docstring
        ray = Child("ray", python)
        ray_version = ray.version or ray.why
        for _ in range(args.rounds):
            for key, n, size, work in spec:
                result = ray.run("Ray streaming", n, size, work)
                if result is not None:
                    results.setdefault(key, {}).setdefault("Ray streaming", []).append(result)
        ray.close()
        ray_why = ray.why
    stdlib = Child("stdlib", sys.executable)
    try:
        with mp.TaskPool(1) as pool:
            runners: dict[str, Callable[[int, int], Any]] = {
                "torch_mp_ext": lambda n, s, w: run_tmx(pool, gen_values, n, s, w),
                "torch_mp_ext (arena-born)":
                    lambda n, s, w: run_tmx(pool, gen_arena_values, n, s, w),
                "mp.Pool.imap": lambda n, s, w: stdlib.run("mp.Pool.imap", n, s, w),
                "ProcessPoolExecutor": lambda n, s, w: stdlib.run("ProcessPoolExecutor", n, s, w),
            }
            runners["torch_mp_ext"](20, 0, 0.0)  # warm-up (the children warmed up already)
            runners["torch_mp_ext (arena-born)"](2, BIG, 0.0)
            for _ in range(args.rounds):
                for key, n, size, work in spec:
                    for name, run in runners.items():
                        if name.endswith("(arena-born)") and size == 0:
                            continue
                        result = run(n, size, work)
                        if result is not None:
                            results.setdefault(key, {}).setdefault(name, []).append(result)
    finally:
        stdlib.close()
    if stdlib.why:
        raise RuntimeError(f"the standard-library contenders {stdlib.why}")

    names = list(runners) + ["Ray streaming"]
    if args.raw:
        for key, by_name in results.items():
            for name, rows in by_name.items():
                print(f"{key:10} {name:26} per item", [fmt(r[0]) for r in rows],
                      "first", [fmt(r[1]) for r in rows])
    header = ["workload", "metric"] + names
    print("Generator task, one worker, consumer reads each value in order: median of "
          f"{args.rounds} (ratio: this / torch_mp_ext; higher = torch_mp_ext faster; "
          "Ray measured in a phase of its own)")
    print(f"Python {platform.python_version()}, torch {torch.__version__}, numpy "
          f"{np.__version__}, Ray {ray_version}, {os.cpu_count()} CPUs, {platform.machine()}")
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("-" * (len(h) + 2) for h in header) + "|")

    def cells(key: str, column: int) -> list[str]:
        base = statistics.median(r[column] for r in results[key]["torch_mp_ext"])
        ray_line = ray_why or "n/a"
        out = []
        for name in names:
            rows = results[key].get(name)
            if rows is None:
                out.append(ray_line if name == "Ray streaming" else "—")
                continue
            med = statistics.median(r[column] for r in rows)
            out.append(fmt(med) if name == "torch_mp_ext" else f"{fmt(med)} ({med / base:.1f}x)")
        return out

    us = f"{WORK * 1e6:.0f} µs"
    labels = {"small": f"int, {args.small} items", "big": f"8 MB array, {args.big} items",
              "work": f"int + {us} work, {args.work_items} items",
              "work x10": f"int + {us} work, {args.work_items * 10} items"}
    for key, _, _, _ in spec:
        if not key.startswith("work"):
            print(f"| {labels[key]} | per item | " + " | ".join(cells(key, 0)) + " |")
        print(f"| {labels[key]} | first item | " + " | ".join(cells(key, 1)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
