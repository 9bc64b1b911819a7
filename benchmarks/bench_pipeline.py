"""Generator pipelines across processes: the Stack Overflow workload, side by side in one run.

The workload of seeds/004 ("fast queue of read-only numpy arrays"): ``xs()`` yields float64
arrays of 500x2000 (8 MB), and three generator stages ``h`` (``x * x``), ``g`` (``x * 3``)
and ``f`` (``x + 1.0``) each run in a thread or process of their own, joined by queues of 3
items; the caller sums the results. Variants:

- ``serial``: ``f(g(h(xs())))`` in one thread;
- ``threads``: the question's decorator with ``threading.Thread`` and ``queue.Queue`` (the
  first answer);
- ``multiprocessing.Queue``: the question's own code (arrays pickled through pipes);
- ``torch.multiprocessing.Queue``: the same with tensors, in processes that never import
  torch_mp_ext (its reducers would replace torch's);
- ``seed ArrayQueue``: the answer's ``ArrayQueue`` (a pool of ``multiprocessing.Array``,
  ids through queues, a copy out in ``get``);
- ``tmx ArrayQueue``: the same decorator with ``torch_mp_ext.ArrayQueue`` (no copy out);
- ``tmx pipeline``: ``torch_mp_ext.pipeline(xs, h, g, f)``;
- ``tmx @stage``: ``f(g(h(xs())))`` with ``@torch_mp_ext.stage(3)`` (xs iterated by a thread
  of the caller).

A second workload makes one stage GIL-bound: ``scan`` runs a Python loop over the first
elements of every row (numpy scalars, so the GIL is held throughout) before ``x * 3``. Threads
cannot overlap it with each other; processes can, and a per-item stage can have ``workers``.

Each measurement runs in a fresh interpreter (imports not timed; process start-up is), the
variants interleaved round by round; the table gives medians. Every variant's sum is checked
against the serial one. Arrays are ``RandomState(i).uniform`` so every process makes the same.
``--arrays 1000`` is the question's size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

SHAPE = (500, 2000)
BUFFER = 3
# Elements per row (of 2000) the GIL-bound stage loops over; --gil-elements sets it.
GIL_ELEMENTS = int(os.environ.get("BENCH_GIL_ELEMENTS", 1000))


def xs(n: int) -> Iterator[np.ndarray]:
    for i in range(n):
        yield np.random.RandomState(i).uniform(0, 1, SHAPE)


def h(items: Any) -> Iterator[Any]:
    for x in items:
        yield x * x


def g(items: Any) -> Iterator[Any]:
    for x in items:
        yield x * 3


def f(items: Any) -> Iterator[Any]:
    for x in items:
        yield x + 1.0


def scan_one(x: Any) -> Any:
    """GIL-bound: a Python loop over each row's first elements, then ``x * 3``."""
    acc = 0.0
    for row in x:
        for v in row[:GIL_ELEMENTS]:
            acc += v
    return x * 3 + (acc - acc)  # the loop's result joins the stream (adding 0.0)


def scan(items: Any) -> Iterator[Any]:
    for x in items:
        yield scan_one(x)


class _End:
    pass


# ---- the question's decorator, over any queue and process (or thread) class ---------------


def decorator(make_queue: Callable[[], Any], start: Callable[..., Any],
              make_event: Callable[[], Any]) -> Callable[..., Any]:
    """The question's ``parallel_pipeline``: each stage runs in its own worker, feeding a
    queue the caller's generator drains. Two fixes: workers are joined, and a worker waits
    until its queue was drained before it exits (torch's file_descriptor strategy serves a
    tensor's fd from the sending process: the question's code fails there otherwise)."""

    def wrap(stage: Callable[[Any], Iterator[Any]]) -> Callable[[Any], Iterator[Any]]:
        def feed(items: Any, q: Any, drained: Any) -> None:
            for x in stage(items):
                q.put(x)
            q.put(_End())
            drained.wait()

        def drain(items: Any) -> Iterator[Any]:
            q, drained = make_queue(), make_event()
            worker = start(feed, items, q, drained)
            while True:
                x = q.get()
                if isinstance(x, _End):
                    break
                yield x
            drained.set()
            worker.join()

        return drain

    return wrap


def start_thread(target: Callable[..., Any], *args: Any) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def start_process(ctx: Any) -> Callable[..., Any]:
    def start(target: Callable[..., Any], *args: Any) -> Any:
        p = ctx.Process(target=target, args=args)
        p.start()
        return p

    return start


class SeedArrayQueue:
    """The answer's ArrayQueue, as written there (with its template bug fixed)."""

    def __init__(self, template: np.ndarray, maxsize: int) -> None:
        from multiprocessing import Array, Queue

        self.dtype, self.shape, self.byte_count = template.dtype, template.shape, template.nbytes
        self.array_pool = []
        self.free_arrays: Any = Queue(maxsize)
        for i in range(maxsize):
            buf = Array("c", self.byte_count, lock=False)
            self.array_pool.append(np.frombuffer(buf, dtype=self.dtype).reshape(self.shape))
            self.free_arrays.put(i)
        self.q: Any = Queue(maxsize)

    def put(self, item: Any) -> None:
        if type(item) is np.ndarray:
            if item.dtype != self.dtype or item.shape != self.shape:
                raise ValueError("ndarray does not match the template")
            i = self.free_arrays.get()
            self.array_pool[i][:] = item
            self.q.put(i)
        else:
            self.q.put((item,))

    def get(self) -> Any:
        item = self.q.get()
        if type(item) is tuple:
            return item[0]
        arr = self.array_pool[item].copy()
        self.free_arrays.put(item)
        return arr


# ---- variants: each returns the stream of results -----------------------------------------


def run_variant(name: str, workload: str, n: int) -> Iterator[Any]:
    stages = [h, g, f] if workload == "seed" else [h, scan, f]
    if name == "serial":
        out: Any = xs(n)
        for stage in stages:
            out = stage(out)
        return out
    if name.startswith("tmx"):
        import torch_mp_ext as mp

        if name == "tmx pipeline":
            return iter(mp.pipeline(lambda: xs(n), *stages, buffer_size=BUFFER))
        if name == "tmx pipeline workers=2":
            per_item = [h, scan_one, f]  # h and f: generator stages; scan_one: 2 workers
            return iter(mp.pipeline(lambda: xs(n), *per_item, buffer_size=BUFFER, workers=2))
        if name == "tmx @stage":
            out = xs(n)
            for stage in stages:
                out = mp.stage(BUFFER)(stage)(out)
            return iter(out)
        if name == "tmx ArrayQueue":
            ctx = mp.get_context("fork")
            wrap = decorator(lambda: mp.ArrayQueue(np.zeros(SHAPE), BUFFER), start_process(ctx),
                             ctx.Event)
    elif name == "threads":
        wrap = decorator(lambda: queue.Queue(BUFFER), start_thread, threading.Event)
    elif name == "multiprocessing.Queue":
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        wrap = decorator(lambda: ctx.Queue(BUFFER), start_process(ctx), ctx.Event)
    elif name == "seed ArrayQueue":
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        wrap = decorator(lambda: SeedArrayQueue(np.zeros(SHAPE), BUFFER), start_process(ctx),
                         ctx.Event)
    elif name == "torch.multiprocessing.Queue":
        import torch
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("fork")
        wrap = decorator(lambda: ctx.Queue(BUFFER), start_process(ctx), ctx.Event)
        out = (torch.from_numpy(x) for x in xs(n))
        for stage in stages:
            out = wrap(stage)(out)
        return (r.numpy() for r in out)  # summed by numpy, as the others
    else:
        raise ValueError(f"unknown variant {name!r}")
    out = xs(n)
    for stage in stages:
        out = wrap(stage)(out)
    return out


def child(name: str, workload: str, n: int) -> None:
    """Runs one measurement in this fresh interpreter; prints {"seconds", "sum"}."""
    if name.startswith("tmx"):
        import torch_mp_ext  # noqa: F401  (imported before the clock starts, as the others)
    elif name.startswith("torch"):
        import torch.multiprocessing  # noqa: F401
    start = time.perf_counter()
    total = 0.0
    for r in run_variant(name, workload, n):
        total += float(r.sum())
        del r
    print(json.dumps({"seconds": time.perf_counter() - start, "sum": total}))


SEED_VARIANTS = ["serial", "threads", "multiprocessing.Queue", "torch.multiprocessing.Queue",
                 "seed ArrayQueue", "tmx ArrayQueue", "tmx pipeline", "tmx @stage"]
GIL_VARIANTS = ["serial", "threads", "multiprocessing.Queue", "tmx pipeline",
                "tmx pipeline workers=2"]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(name: str, workload: str, n: int) -> Dict[str, float]:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    done = subprocess.run([sys.executable, __file__, "--child", name, "--workload", workload,
                           "--arrays", str(n)], capture_output=True, text=True, timeout=1800,
                          env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} ({workload}) failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(workload: str, variants: List[str], results: Dict[str, List[Dict[str, float]]],
          reference: str) -> List[str]:
    medians = {v: statistics.median(r["seconds"] for r in results[v]) for v in variants}
    sums = {v: results[v][0]["sum"] for v in variants}
    ours = medians[reference]
    fastest = min(medians.values())
    lines = [f"| variant | seconds (median) | vs {reference} | sum |", "|---|---|---|---|"]
    for v in variants:
        ratio = medians[v] / ours
        mark = " (fastest)" if medians[v] == fastest else ""
        lines.append(f"| {v} | {medians[v]:.3f}{mark} | {ratio:.2f}x | {sums[v]:.6f} |")
    same = all(r["sum"] == sums["serial"] for v in variants for r in results[v])
    lines.append("")
    lines.append(f"vs {reference}: each variant's time divided by {reference}'s (above 1: "
                 f"slower than it). All sums equal: {'yes' if same else 'NO'}.")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arrays", type=int, default=200, help="arrays in the stream "
                        "(the question used 1000)")
    parser.add_argument("--gil-arrays", type=int, default=100, help="arrays in the "
                        "GIL-bound workload (each costs about 6x a seed array serially)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--workload", choices=["seed", "gil", "both"], default="both")
    parser.add_argument("--gil-elements", type=int, default=GIL_ELEMENTS, help="elements "
                        "of each row the GIL-bound stage loops over (default %(default)s)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ["BENCH_GIL_ELEMENTS"] = str(args.gil_elements)  # for the children
    if args.child:
        child(args.child, args.workload, args.arrays)
        return 0
    workloads = ["seed", "gil"] if args.workload == "both" else [args.workload]
    plan = {"seed": SEED_VARIANTS, "gil": GIL_VARIANTS}
    count = {"seed": args.arrays, "gil": args.gil_arrays}
    results: Dict[str, Dict[str, List[Dict[str, float]]]] = {
        w: {v: [] for v in plan[w]} for w in workloads}
    for r in range(args.rounds):
        for w in workloads:
            for v in plan[w]:
                results[w][v].append(measure(v, w, count[w]))
                print(f"round {r + 1}/{args.rounds} {w:4s} {v:28s} "
                      f"{results[w][v][-1]['seconds']:.3f} s", file=sys.stderr, flush=True)
    import torch

    sys.path.insert(0, ROOT)
    import torch_mp_ext

    for w in workloads:
        print()
        if w == "seed":
            print(f"Seed workload: {args.arrays} float64 arrays of 500x2000 through h, g, f "
                  f"(queues of {BUFFER}); median of {args.rounds} interleaved rounds")
        else:
            print(f"GIL-bound workload: {args.gil_arrays} arrays through h, scan (a Python "
                  f"loop over the first {args.gil_elements} elements of each row, then x * 3), f; "
                  f"median of {args.rounds} interleaved rounds")
        print()
        print("\n".join(table(w, plan[w], results[w], "tmx pipeline")))
    print(f"python {platform.python_version()}, numpy {np.__version__}, torch "
          f"{torch.__version__}, torch_mp_ext {torch_mp_ext.__version__}, "
          f"{os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
