"""Writes of daemon threads after a process let go of its blocks at exit land nowhere
another process sees (Note [Late writes at exit] in csrc/shm/registry.cpp)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest

import torch_mp_ext as mp

ROOT = Path(__file__).resolve().parent.parent
T = 60.0

CHILD = """
import atexit, pickle, sys, threading, time
atexit.register(time.sleep, 2.0)  # registered first, so it runs after torch_mp_ext let go
import torch_mp_ext as mp
x = pickle.loads(sys.stdin.buffer.read()).numpy()  # writes in Python, not inside torch:
def scribble():  # a daemon thread stopped at exit inside a C++ op aborts Python 3.11
    while True:
        x[:] = 1
threading.Thread(target=scribble, daemon=True).start()
print("writing", flush=True)
"""


@pytest.mark.slow  # a child that lingers 2 s in its exit handlers on purpose
def test_a_daemon_thread_writing_at_exit_never_reaches_the_blocks_next_tensor():
    t = mp.zeros(1024)
    address = t.data_ptr()
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
    try:
        child.stdin.write(bytes(ForkingPickler.dumps(t)))
        child.stdin.close()
        assert child.stdout.readline() == b"writing\n"
        del t  # the child's reference is the last one; it drops it at exit
        held, deadline = [], time.monotonic() + T
        while True:
            b = mp.zeros(1024)
            if b.data_ptr() == address:
                break
            held.append(b)  # not the block yet: keep it so the next allocation goes on
            assert time.monotonic() < deadline, "the child never let go of the block"
            time.sleep(0.005)
        exiting = child.poll() is None  # its daemon thread still runs
        b.fill_(7)
        time.sleep(0.5)
        assert bool(b.eq(7).all()), "a write of the exiting child landed in our new tensor"
    finally:
        child.wait(T)
        child.stdout.close()
    assert child.returncode == 0
    assert exiting, "the child exited before its block came back: the window was not tested"
