"""A parent whose spawn child dies before it opens its start payload (Note [Unopened payloads]
in torch_mp_ext/processes/payload.py). Run as a script by tests/test_unopened_payloads.py:

    python _unopened_script.py MODE FLAG_PATH

MODE ``kill``: the child SIGKILLed while it imports this main module; ``raise``: the child's
import of it fails. Prints one JSON line: the child's exit code and the parent's arena after
it dropped its own queue and tensor.
"""

import gc
import json
import os
import signal
import sys
import time

import torch_mp_ext as mp
from torch_mp_ext.sharing.arena import memory_stats

MODE, FLAG = sys.argv[1], sys.argv[2]

if __name__ == "__mp_main__":  # a spawn child, importing its main module
    if MODE == "raise":
        raise RuntimeError("this main module cannot be imported in a child")
    open(FLAG, "w").close()
    time.sleep(120)  # killed here


def child(q, t, simple, ch):
    q.put(float(t.sum()))


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q, simple, t = ctx.Queue(), ctx.SimpleQueue(), mp.zeros(1 << 16)
    ch = mp.StateDictChannel({"w": t})
    p = ctx.Process(target=child, args=(q, t, simple, ch))
    p.start()
    if MODE == "kill":
        deadline = time.monotonic() + 60
        while not os.path.exists(FLAG):
            if time.monotonic() > deadline or p.exitcode is not None:
                raise SystemExit("the child never reached its main module's import")
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGKILL)
    p.join(60)
    code = p.exitcode
    p.close()
    del p, q, simple, t, ch
    gc.collect()
    mp.empty_cache()
    stats = memory_stats()
    print(json.dumps({"exitcode": code, "live_blocks": stats["live_blocks"],
                      "live_refs": stats["live_refs"]}))
