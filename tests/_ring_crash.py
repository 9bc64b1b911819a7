"""Run by tests/csrc/test_ring.py in a fresh interpreter: a process SIGKILLed at each step of
Note [Ring commit]. Prints one JSON object per scenario. (Killed processes keep their block
references, so this runs apart from the per-test leak check: everything dies with it.)"""

from __future__ import annotations

import json
import multiprocessing
import sys

import _queue_workers as workers

from torch_mp_ext import _C
from torch_mp_ext.sharing import memory as _memory


def new_ring(capacity):
    return _C.Ring.create(_memory.allocate(_C.Ring.footprint(capacity)), capacity)


def frames(ring):
    return [[tag, data.decode()] for tag, data in ring.drain()]


def crash_point(point, op):
    ring = new_ring(256)
    ring.put(b"first", 1, 0.0)
    ctx = multiprocessing.get_context("fork")
    victim = ctx.Process(target=workers.ring_die_at,
                         args=(ring.share(), point, op, b"second" * 5))
    victim.start()
    victim.join(30)
    status = ring.put(b"third", 3, 0.0)
    return {"exitcode": victim.exitcode, "put_after": status, "recoveries": ring.recoveries,
            "broken": ring.broken, "frames": frames(ring), "holders": ring.holders}


def hold_and_die():
    ring = new_ring(4096)
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    victim = ctx.Process(target=workers.ring_hold_forever, args=(ring.share(), ready))
    victim.start()
    ready.wait(30)
    victim.join(30)
    put = ring.put(b"after", 0, 1.0)
    got = ring.get(1.0)
    return {"exitcode": victim.exitcode, "put_after": put, "got": got.decode(),
            "recoveries": ring.recoveries}


def main():
    out = {}
    for point, op in [(1, "put"), (2, "put"), (3, "put"), (4, "get"), (5, "get")]:
        out[f"{point}-{op}"] = crash_point(point, op)
    out["hold"] = hold_and_die()
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
