"""Module-level child targets for the CUDA-sharing tests (spawn imports them by name)."""

from __future__ import annotations

import time

from torch_mp_ext import _C


def forward_chain(name, segment_id, tag, first_slot, seconds, q, finish):
    """Keeps `tag` referenced while moving it from slot to slot, as forwarders do: acquire
    a new slot with the tag, then release the old one (Note [Counter snapshots]). Reports
    the number of moves, and releases the last slot once `finish` is set."""
    counters = _C.CounterFile.open(name, segment_id)
    old, moves = first_slot, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = counters.acquire(1, tag)
        if got is None:
            continue
        counters.add(old, -1)
        old, moves = got[0], moves + 1
    q.put(moves)
    finish.wait(60)
    counters.add(old, -1)
