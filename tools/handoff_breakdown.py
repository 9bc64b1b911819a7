"""Where an arena-born tensor's hand-off goes: the sender's record, the ring, the wake-up, the
receiver's rebuild; and the same hand-off with the Python layers cut away.

Not a benchmark (it compares nothing side by side): a diagnostic for issue 15. Each trial
is shaped like bench_tensor_transfer's (an idle gap, two untimed 4 KB warm-ups, the timed
hand-off, the consumer's acknowledgement, then its float64 sum), so its cold caches are the
benchmark's. Modes:

- ``parts``: ``Queue.put``/``get`` split into the sender's record, ``ring.put``, the time
  until the receiver's ``ring.get`` returned, and its rebuild;
- ``full``: ``SimpleQueue.put`` / ``get`` as users call them;
- ``lean``: what remains without the Python layers: one ``share_record`` with the shape
  known in advance, ``ring.put``, ``ring.get``, ``take_record`` and ``torch.frombuffer``
  (no checks, no cache): what a hand-off costs once the per-hand-off torch calls are gone.

    python tools/handoff_breakdown.py [--mode parts|full|lean] [--strategy file_descriptor]
        [--trials 150] [--gap 0.005]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # Note [Idle OpenMP threads spin]

import torch

import torch_mp_ext as mp
from torch_mp_ext import _C
from torch_mp_ext.sharing import records
from torch_mp_ext.sharing.pickling import TAG_RECORD

NUMEL = 1024  # 4 KB of float32


def consume(q, acks, mode):
    ring = q._ring
    while True:
        if mode == "full":
            got = q.get()
            t0 = t1 = time.perf_counter()
        else:
            frame = ring.get(-1.0)
            t0 = time.perf_counter()
            if type(frame) is bytes:  # None: stop
                break
            if mode == "lean":
                block = _C.take_record(frame[1])[-1]
                got = torch.frombuffer(block, dtype=torch.float32, count=NUMEL)
                del block
            else:
                got = records.rebuild(frame[1])
            t1 = time.perf_counter()
        if got is None:
            break
        acks.put((t0, t1))
        total = float(got.sum(dtype=torch.float64))
        del got
        acks.put(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["parts", "full", "lean"], default="parts")
    parser.add_argument("--strategy", default="file_descriptor")
    parser.add_argument("--trials", type=int, default=150)
    parser.add_argument("--gap", type=float, default=0.005, help="idle seconds before a trial")
    args = parser.parse_args()
    mp.set_sharing_strategy(args.strategy)
    ctx = mp.get_context("spawn")
    q, acks = ctx.SimpleQueue(), ctx.SimpleQueue()
    consumer = ctx.Process(target=consume, args=(q, acks, args.mode), daemon=True)
    consumer.start()
    ring = q._ring

    def send(t):
        if args.mode == "full":
            q.put(t)
            return
        if args.mode == "lean":
            data = _C.share_record(t.untyped_storage().data_ptr(), NUMEL * 4, 0, (NUMEL,),
                                   (1,), 0, records.KIND_TENSOR, records.DENSE)[0]
        else:
            data = records.share_tensor(t)
        ring.put(data, TAG_RECORD, -1.0)

    parts: dict = {"record": [], "ring put": [], "wake": [], "rebuild": [], "total": []}
    for i in range(args.trials + 5):
        time.sleep(args.gap)
        item = mp.empty(NUMEL).fill_(1.0)
        for _ in range(2):  # Note [Warm hand-offs] in torch_mp_ext_demo/handoff_worker.py
            warm = mp.empty(NUMEL).fill_(1.0)
            send(warm)
            acks.get()
            acks.get()
            del warm
        start = time.perf_counter()
        if args.mode == "parts":
            data = records.share_tensor(item)
            mid = time.perf_counter()
            ring.put(data, TAG_RECORD, -1.0)
        else:
            send(item)
            mid = start
        sent = time.perf_counter()
        t0, t1 = acks.get()
        acks.get()
        del item
        if i >= 5:  # the first trials warm everything up
            parts["record"].append(mid - start)
            parts["ring put"].append(sent - mid)
            parts["wake"].append(t0 - sent)
            parts["rebuild"].append(t1 - t0)
            parts["total"].append(t1 - start)
    q.put(None)
    consumer.join(30)
    shown = parts if args.mode == "parts" else {"total": parts["total"]}
    print(f"{args.mode}, {args.strategy}, {args.trials} trials, gap {args.gap * 1e3:g} ms: "
          + ", ".join(f"{k} {statistics.median(v) * 1e6:.1f} us" for k, v in shown.items()))


if __name__ == "__main__":
    main()
