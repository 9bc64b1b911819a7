"""Queue throughput, one producer process to one consumer, side by side in one run.

Compares torch_mp_ext's Queue with ``multiprocessing.Queue``, ``torch.multiprocessing.Queue``
and faster-fifo (skipped with a note if it is not installed) on small items (an int, a small
tuple), 1 MB and 64 MB ``bytes`` items, with single ``put``/``get`` and, where a queue has them,
``put_many``/``get_many`` in batches of 64. Libraries run interleaved (every library once per
round, rounds repeated) and the table reports medians, so machine noise hits all alike.

The consumer is the parent process; the producer is a forked child released by an event, so
process start-up is not timed. Run ``python benchmarks/bench_queue.py --help`` for options.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import bench_json
import torch.multiprocessing

import torch_mp_ext

try:
    import faster_fifo
except ImportError:  # optional: installed for this benchmark only
    faster_fifo = None

BATCH = 64
QUEUE_BYTES = 4 * 1024 * 1024 - 4096
TIMEOUT = 120.0

WORKLOADS: Dict[str, Any] = {
    "int": 7,
    "small tuple": (1, 2.0, "abc"),
    "1 MB bytes": b"x" * (1 << 20),
    "64 MB bytes": b"x" * (64 << 20),  # out of line (Note [Large items out of line])
}


def make_queue(lib: str) -> Any:
    if lib == "torch_mp_ext":
        return torch_mp_ext.get_context("fork").Queue()
    if lib == "multiprocessing":
        return multiprocessing.get_context("fork").Queue()
    if lib == "torch.multiprocessing":
        return torch.multiprocessing.get_context("fork").Queue()
    if lib == "faster-fifo":
        return faster_fifo.Queue(max_size_bytes=QUEUE_BYTES)
    raise ValueError(lib)


def has_batches(lib: str) -> bool:
    return lib in ("torch_mp_ext", "faster-fifo")


def produce(lib: str, q: Any, item: Any, n: int, batched: bool, go: Any) -> None:
    go.wait(TIMEOUT)
    if batched and lib == "torch_mp_ext":
        chunk = [item] * BATCH
        for start in range(0, n, BATCH):
            q.put_many(chunk if start + BATCH <= n else [item] * (n - start), timeout=TIMEOUT)
    elif batched and lib == "faster-fifo":
        chunk = [item] * BATCH
        for start in range(0, n, BATCH):
            q.put_many(chunk if start + BATCH <= n else [item] * (n - start), timeout=TIMEOUT)
    else:
        put = q.put
        for _ in range(n):
            put(item, True, TIMEOUT)


def consume(lib: str, q: Any, n: int, batched: bool) -> None:
    got = 0
    if batched and lib == "torch_mp_ext":
        while got < n:
            got += len(q.get_many(BATCH, timeout=TIMEOUT))
    elif batched and lib == "faster-fifo":
        while got < n:
            got += len(q.get_many(block=True, timeout=TIMEOUT, max_messages_to_get=BATCH))
    else:
        get = q.get
        for _ in range(n):
            get(True, TIMEOUT)


def run_once(lib: str, item: Any, n: int, batched: bool) -> float:
    """Items per second of one producer → one consumer transfer of ``n`` items."""
    ctx = multiprocessing.get_context("fork")
    q = make_queue(lib)
    go = ctx.Event()
    producer = ctx.Process(target=produce, args=(lib, q, item, n, batched, go), daemon=True)
    producer.start()
    time.sleep(0.05)  # let the child settle: its start-up is not part of the measure
    t0 = time.perf_counter()
    go.set()
    consume(lib, q, n, batched)
    elapsed = time.perf_counter() - t0
    producer.join(TIMEOUT)
    if hasattr(q, "close"):
        q.close()
    return n / elapsed


# ---- ping-pong latency (issue 15): one small message each way, the peer echoing it --------

PING_KINDS = ["Python pipe", "torch_mp_ext Queue", "torch_mp_ext SimpleQueue",
              "multiprocessing Queue", "multiprocessing SimpleQueue",
              "torch.multiprocessing Queue", "torch.multiprocessing SimpleQueue"]


def _ping_pair(kind: str) -> Tuple[Any, Any]:
    if kind == "Python pipe":
        return os.pipe(), os.pipe()
    lib, cls = kind.rsplit(" ", 1)
    mod = {"torch_mp_ext": torch_mp_ext, "multiprocessing": multiprocessing,
           "torch.multiprocessing": torch.multiprocessing}[lib]
    ctx = mod.get_context("fork")
    return getattr(ctx, cls)(), getattr(ctx, cls)()


def _echo(kind: str, a: Any, b: Any, trips: int, cpu: Optional[int]) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    if kind == "Python pipe":
        for _ in range(trips):
            os.write(b[1], os.read(a[0], 64))
        return
    for _ in range(trips):
        b.put(a.get())
    if hasattr(b, "join_thread"):  # a feeder thread must flush the last reply before exit
        b.close()
        b.join_thread()


def ping_pong(kind: str, trips: int, pinned: bool) -> float:
    """Median one-way latency (half a round trip) of a small message, in seconds."""
    a, b = _ping_pair(kind)
    cpus = sorted(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("fork")
    peer = ctx.Process(target=_echo, args=(kind, a, b, trips, cpus[1] if pinned else None),
                       daemon=True)
    peer.start()
    mask = os.sched_getaffinity(0)
    if pinned:
        os.sched_setaffinity(0, {cpus[0]})
    times = []
    try:
        if kind == "Python pipe":
            for _ in range(trips):
                t0 = time.perf_counter()
                os.write(a[1], b"ping")
                os.read(b[0], 64)
                times.append(time.perf_counter() - t0)
        else:
            for i in range(trips):
                t0 = time.perf_counter()
                a.put(i)
                b.get(True, TIMEOUT) if "SimpleQueue" not in kind else b.get()
                times.append(time.perf_counter() - t0)
    finally:
        os.sched_setaffinity(0, mask)
        peer.join(TIMEOUT)
    if kind == "Python pipe":
        for fd in (*a, *b):
            os.close(fd)
    return statistics.median(times[trips // 10:]) / 2


def run_ping_pong(trips: int, rounds: int) -> List[Dict[str, Any]]:
    regimes = [False] + ([True] if len(os.sched_getaffinity(0)) >= 2 else [])
    samples: Dict[Tuple[bool, str], List[float]] = {}
    for _ in range(rounds):
        for pinned in regimes:
            for kind in PING_KINDS:
                samples.setdefault((pinned, kind), []).append(ping_pong(kind, trips, pinned))
    rows = []
    for pinned in regimes:
        floor = statistics.median(samples[(pinned, "Python pipe")])
        for kind in PING_KINDS:
            med = statistics.median(samples[(pinned, kind)])
            rows.append({"series": kind, "pinned": pinned, "median_one_way_s": med,
                         "vs_pipe": med / floor, "samples_s": samples[(pinned, kind)]})
    return rows


def print_ping_pong(rows: List[Dict[str, Any]], trips: int, rounds: int) -> None:
    print("| one-way latency, ping-pong, small message | regime | median | vs Python pipe |")
    print("|---|---|---|---|")
    for row in rows:
        regime = "pinned, one CPU each" if row["pinned"] else "unpinned"
        print(f"| {row['series']} | {regime} | {row['median_one_way_s'] * 1e6:.1f} us | "
              f"{row['vs_pipe']:.2f}x |")
    print()
    print(f"Half the round trip of a small message echoed by a forked peer, median of "
          f"{trips} trips (first tenth dropped), median of {rounds} interleaved rounds.")
    print()


def fmt_rate(rate: Optional[float]) -> str:
    if rate is None:
        return "n/a"
    if rate >= 1e6:
        return f"{rate / 1e6:.2f} M/s"
    if rate >= 1e3:
        return f"{rate / 1e3:.1f} k/s"
    return f"{rate:.0f} /s"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--small-items", type=int, default=100_000)
    parser.add_argument("--big-items", type=int, default=600)
    parser.add_argument("--huge-items", type=int, default=10, help="64 MB items per run")
    parser.add_argument("--trips", type=int, default=2000, help="ping-pong round trips")
    bench_json.add_argument(parser)
    args = parser.parse_args(argv)
    ping_rows = run_ping_pong(args.trips, args.rounds)
    print_ping_pong(ping_rows, args.trips, args.rounds)

    libs = ["torch_mp_ext", "multiprocessing", "torch.multiprocessing"]
    notes = []
    if faster_fifo is not None:
        libs.append("faster-fifo")
    else:
        notes.append("faster-fifo is not installed: its column is skipped "
                     "(pip install faster-fifo to include it).")
    rows: List[Tuple[str, str, Any, int, bool]] = []
    for name, item in WORKLOADS.items():
        big = isinstance(item, bytes)
        n = (args.huge_items if len(item) > (1 << 20) else args.big_items) if big \
            else args.small_items
        rows.append((name, "put/get", item, n, False))
        if not big:  # 64 x 1 MB cannot fit in a 4 MB queue: batches are for small items
            rows.append((name, f"put_many/get_many x{BATCH}", item, n, True))

    results: Dict[Tuple[int, str], List[float]] = {}
    for _ in range(args.rounds):
        for r, (_name, _mode, item, n, batched) in enumerate(rows):
            for lib in libs:
                if lib == "faster-fifo" and isinstance(item, bytes) and len(item) > QUEUE_BYTES:
                    continue  # larger than its buffer: it cannot carry this item at all
                # Queues without a batch API move the batch workload one item at a time.
                use_batches = batched and has_batches(lib)
                results.setdefault((r, lib), []).append(run_once(lib, item, n, use_batches))

    header = ["items", "mode"] + libs + ["vs mp.Queue"] + (["vs faster-fifo"] if
                                                             "faster-fifo" in libs else [])
    table = []
    for r, (name, mode, _item, _n, batched) in enumerate(rows):
        med: Dict[str, Optional[float]] = {
            lib: statistics.median(results[(r, lib)]) if (r, lib) in results else None
            for lib in libs}
        ours, theirs = med["torch_mp_ext"] or 0.0, med["multiprocessing"] or 1.0
        line = [name, mode] + [fmt_rate(med[lib]) + ("*" if batched and not has_batches(lib)
                                                     else "") for lib in libs]
        line.append(f"{ours / theirs:.1f}x")
        if "faster-fifo" in libs:
            ff = med["faster-fifo"]
            line.append(f"{ours / ff:.1f}x" if ff else "n/a")
        table.append(line)
    widths = [max(len(str(row[i])) for row in [header] + table) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in table:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |")
    print()
    print(f"1 producer -> 1 consumer process (fork), items/s, median of {args.rounds} "
          f"interleaved rounds; {args.small_items} small items, {args.big_items} x 1 MB, "
          f"{args.huge_items} x 64 MB per run. * no batch API: put/get one item at a time.")
    for note in notes:
        print(note)
    if args.json:
        bench_json.write(args.json, "bench_queue", [
            {"series": lib, "items": name, "mode": mode, "n": n,
             "batched_api": batched and has_batches(lib),
             "median_items_per_s": statistics.median(results[(r, lib)]),
             "samples_items_per_s": results[(r, lib)]}
            for r, (name, mode, _item, n, batched) in enumerate(rows) for lib in libs
        ], params=vars(args), rows_doc="items/s, 1 producer -> 1 consumer, per queue and "
                                          "workload", extra={"latency_rows": ping_rows})
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"torch_mp_ext {torch_mp_ext.__version__}"
          + (f", faster-fifo {importlib.metadata.version('faster-fifo')}" if faster_fifo else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
