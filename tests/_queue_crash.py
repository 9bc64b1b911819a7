"""Run by tests/test_queue_crash.py in a fresh interpreter: producers and consumers SIGKILLed
at random points while a steady producer and consumer keep using the queue.

Prints a JSON report. Killed processes keep their block references and holders (they cannot
let go), so this runs apart from the per-test leak check: everything dies with it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import select
import signal
import sys
import time

import _queue_workers as workers

import torch_mp_ext as mp

SIZES = [16, 60_000, 200, 3_000, 90_000]  # big frames: long copies under the lock


def read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def main(kills, seed, growing=False):
    rng = random.Random(seed)
    ctx = mp.get_context("fork")
    stdlib = multiprocessing.get_context("fork")
    # growing: a ring of 512 KiB at first (TORCH_MP_EXT_QUEUE_BYTES, set by the test) that
    # grows and shrinks back all the time (Note [Ring growth]), 64 items at most.
    q = ctx.Queue(maxsize=64) if growing else ctx.Queue(max_bytes=512 * 1024)
    stop_producing, stop_consuming = stdlib.Event(), stdlib.Event()
    results = stdlib.Queue()  # reports travel outside the queue under test
    steady_p = ctx.Process(target=workers.steady_producer,
                           args=(q, 0, stop_producing, SIZES, results))
    steady_c = ctx.Process(target=workers.steady_consumer, args=(q, results, stop_consuming))
    steady_p.start()
    steady_c.start()

    victim_items, victim_torn, produced, killed = [], 0, {}, {"producer": 0, "consumer": 0}
    armed = 0
    t0 = time.monotonic()
    for i in range(kills):
        role = "producer" if i % 2 == 0 else "consumer"
        # Most victims are killed from outside at a random moment; every fifth dies by itself
        # at a random step of the commit protocol, inside the lock, while the others run.
        point = 0 if i % 5 != 4 else rng.choice([1, 2, 3] if role == "producer" else [1, 4, 5])
        armed += point != 0
        read_fd, write_fd = os.pipe()
        if role == "producer":
            pid_tag = 1000 + i
            target, args = workers.victim_producer, (q, pid_tag, SIZES, write_fd, point)
        else:
            target, args = workers.victim_consumer, (q, write_fd, point)
        victim = ctx.Process(target=target, args=args)
        victim.start()
        os.close(write_fd)
        # Kill it while it works, not while it starts: once it reported its first item, at a
        # random moment in the next few milliseconds (often inside put/get, or holding the lock).
        select.select([read_fd, victim.sentinel], [], [], 5.0)
        time.sleep(rng.uniform(0.0, 0.008))
        os.kill(victim.pid, signal.SIGKILL)  # a zombie already: harmless
        victim.join(30)
        killed[role] += victim.exitcode == -signal.SIGKILL
        data = read_all(read_fd)
        os.close(read_fd)
        if role == "producer":
            seqs = [int.from_bytes(data[k:k + 4], "little") for k in range(0, len(data) - 3, 4)]
            produced[pid_tag] = len(seqs)
        else:
            for k in range(0, len(data) - 6, 7):
                producer = int.from_bytes(data[k:k + 2], "little")
                seq = int.from_bytes(data[k + 2:k + 6], "little")
                victim_items.append((producer, seq))
                victim_torn += data[k + 6] == 0
    kill_phase_s = time.monotonic() - t0

    # The survivors were never wedged: a fresh round trip works at once.
    t1 = time.monotonic()
    q.put("alive", timeout=5)
    stop_producing.set()
    steady_p.join(30)
    stop_consuming.set()
    reports = dict((r[0], r[1:]) for r in (results.get(timeout=60), results.get(timeout=60)))
    (steady_produced,), (seen, torn) = reports["produced"], reports["consumed"]
    steady_c.join(30)
    tail_s = time.monotonic() - t1
    seen = [tuple(x) for x in seen]
    alive_seen = ("alive", -1) in seen

    everything = seen + victim_items
    per_producer_order_ok = True
    last = {}
    for producer, seq in seen:
        if isinstance(producer, str):
            continue
        if seq <= last.get(producer, -1):
            per_producer_order_ok = False
        last[producer] = seq
    report = {
        "kills": killed,
        "kill_phase_s": round(kill_phase_s, 2),
        "tail_s": round(tail_s, 2),
        "steady_consumer_items": len(seen),
        "victim_consumer_items": len(victim_items),
        "torn": torn + victim_torn,
        "duplicates": len(everything) - len(set(everything)),
        "per_producer_order_ok": per_producer_order_ok,
        "committed_at_least": steady_produced + sum(produced.values()),
        "received": len(everything) - 1,  # minus the probe
        "armed": armed,
        "recoveries": q._ring.recoveries,
        "broken": q._ring.broken,
        "steady_exitcodes": [steady_p.exitcode, steady_c.exitcode],
        "alive_seen": alive_seen,
        "left_in_queue": q.qsize(),
    }
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 60,
         int(sys.argv[2]) if len(sys.argv) > 2 else 0,
         len(sys.argv) > 3 and sys.argv[3] == "growing")
