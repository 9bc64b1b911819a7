"""Pooled file_system names (Note [Pooled names] in csrc/shm/arena.h): a segment in use is
never retired by the expiry thread."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BUSY = """
import os, time, torch_mp_ext as mp
mp.set_sharing_strategy("file_system")
names = set()
prefix = f"torch_{os.getpid()}_"
for _ in range(12):  # 3.6 s: more than three expiry periods of 1 s
    t = mp.empty(1024)
    names |= {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    del t
    time.sleep(0.3)
print(len(names))
"""


def test_a_named_segment_allocated_from_between_ticks_is_not_retired():
    """Issue 26: allocation never reset the expiry's count of free ticks, so a segment used
    every 0.3 s looked free for ever and was retired every second (3 names in 3.6 s)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TORCH_MP_EXT_NAMED_CACHE_S="1", TORCH_MP_EXT_EXIT_LINGER_S="0")
    done = subprocess.run([sys.executable, "-c", BUSY], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "1", done.stdout
