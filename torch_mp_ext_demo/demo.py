"""``python -m torch_mp_ext demo``: workers sharing tensors and arrays, then a timing.

What it shows, step by step (each line printed says what happened):

1. the parent sends a plain tensor to a worker, the worker writes into it, and the parent
   sees the write (the tensor was moved into shared memory in place when sent);
2. a worker creates a numpy array in shared memory and sends it back; the parent writes into
   it and the worker sees that write (zero copies both ways);
3. the hand-off time of tensors from put() until the receiver holds them, side by side with
   torch.multiprocessing, in the same run.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

import torch_mp_ext as mp

from . import handoff

__all__ = ["run"]


def _worker(rank: int, inbox, outbox, done) -> None:
    if rank == 0:
        weights = inbox.get(timeout=120)
        weights[rank] = 42.0  # lands in the parent's tensor
        outbox.put(("wrote", rank, os.getpid()))
    else:
        frames = mp.empty_array((3, 4), np.float32)
        frames[...] = rank
        outbox.put(("array", frames))
        done.wait(120)  # the parent writes into the array meanwhile
        outbox.put(("seen", float(frames.sum())))
    done.wait(120)


def _step(text: str) -> None:
    print(f"  - {text}", flush=True)


def run(repeats: int = 5, quick: bool = False) -> int:
    print(f"torch_mp_ext {mp.__version__} demo (torch {torch.__version__}, pid {os.getpid()})")
    print("1. sharing between processes (spawn context)")
    ctx = mp.get_context("spawn")  # type: ignore[attr-defined]  # set from the context
    inboxes = [ctx.Queue() for _ in range(2)]
    outbox, done = ctx.Queue(), ctx.Event()
    start = time.monotonic()
    procs = [ctx.Process(target=_worker, args=(r, inboxes[r], outbox, done)) for r in range(2)]
    for p in procs:
        p.start()
    weights = torch.zeros(4)
    inboxes[0].put(weights)
    got = {}
    for _ in range(2):
        message = outbox.get(timeout=120)
        got[message[0]] = message
    _step(f"started 2 workers in {time.monotonic() - start:.1f} s")
    _step(f"worker 0 (pid {got['wrote'][2]}) wrote into the parent's tensor: {weights.tolist()}")
    frames = got["array"][1]
    _step(f"worker 1 sent an array born in shared memory: shape {frames.shape}, "
          f"sum {frames.sum():g}, shared={mp.is_shared(frames)}")
    frames += 10
    done.set()
    seen = outbox.get(timeout=120)[1]
    _step(f"the parent added 10 to it; worker 1 now sees sum {seen:g} (expected "
          f"{frames.sum():g})")
    for p in procs:
        p.join(60)
    del frames
    ok = weights[0] == 42.0 and seen == float(12 * 11)
    print("2. hand-off time, put() until the receiver holds the tensor (medians, same run)")
    sizes = [4 << 10, 1 << 20, 16 << 20] if quick else [4 << 10, 1 << 20, 64 << 20]
    variants = [v for v in handoff.VARIANTS if v.label in (
        "torch fd fresh", "torch fd pre-shared", "tmx fd fresh", "tmx fd arena-born")]
    results = handoff.run_handoff(sizes, 3 if quick else repeats, variants,
                                   progress=lambda i, n: print(f"  round {i}/{n}", flush=True))
    print(handoff.format_table(results))
    if results.failures:
        print(f"WRONG DATA in {results.failures}")
        ok = False
    print("demo ok" if ok else "demo FAILED")
    return 0 if ok else 1
