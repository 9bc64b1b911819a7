"""HostRelay on one host: a learner rank, a relay rank and its two collector processes.

Across two real hosts (network namespaces) the same runs in test_multihost.py (slow tier).
"""

from __future__ import annotations

import os
import signal

import _exchange_workers as w
import pytest
import torch.distributed as dist
from test_exchange_dist import _with_env

import torch_mp_ext as mp
from torch_mp_ext.processes.launch import free_port

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _run(kill_after: int) -> tuple[list, tuple, list, list]:
    ctx = mp.get_context("fork")
    go, out = ctx.Queue(), ctx.Queue()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = []
    for rank, target, args in ((0, w.relay_learner, (20, kill_after, go, out)),
                               (1, w.relay_rank, (go, out))):
        p = ctx.Process(target=_with_env, args=(dict(env, RANK=str(rank)), target, args))
        p.start()
        procs.append(p)
    try:
        results = [out.get(timeout=90) for _ in range(3 if kill_after >= 0 else 4)]
    finally:
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
    relay = next(r for r in results if r[0] == "relay")
    learner = [r for r in results if r[0] == "learner"]
    collectors = sorted(r for r in results if r[0] not in ("relay", "learner"))
    return [p.exitcode for p in procs], relay, collectors, learner


def test_relay_republishes_whole_versions_and_relays_contexts():
    exits, relay, collectors, learner = _run(kill_after=-1)
    assert exits == [0, 0]
    assert relay == ("relay", 19, "finished")
    assert learner == [("learner", [0, 1])]  # contexts came up through the relay
    assert [index for index, _, _ in collectors] == [0, 1]
    for index, reads, end in collectors:
        versions = [v for v, _, _ in reads]
        assert end == "finished"
        assert all(value == v for v, value, _ in reads), reads  # one whole version each
        assert versions == sorted(set(versions)) and versions[-1] == 19
        # collector 1 reads in place: its state views the host's channel, never a copy
        assert [views for _, _, views in reads] == [index == 1] * len(reads)


def test_a_killed_learner_is_a_peer_death_for_the_relay_and_its_collectors():
    exits, relay, collectors, _ = _run(kill_after=3)
    assert exits[0] == -signal.SIGKILL
    assert relay[2] == "PeerDiedError" and relay[1] >= 0
    for _, reads, end in collectors:  # collector 1 reading in place too
        assert end == "PeerDiedError", (reads, end)  # never a normal finish
        assert all(value == v for v, value, _ in reads)
