"""The exchangers over torch.distributed: three gloo ranks on loopback, for real."""

from __future__ import annotations

import _exchange_workers as w
import pytest
import torch.distributed as dist
from test_spawn import get

import torch_mp_ext as mp

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def test_learner_and_two_collectors_over_gloo():
    q = mp.get_context("forkserver").SimpleQueue()
    mp.launch(w.gloo_worker, args=(q,), nprocs=3)
    results = [get(q) for _ in range(3)]
    (_, published, merged, env_step), = [r for r in results if r[0] == "learner"]
    assert published == list(range(len(published)))
    assert merged == sorted((r, s, k) for r in (1, 2) for s in range(w.STEPS) for k in range(3))
    assert env_step == 2 * w.STEPS * 10
    collectors = sorted(r[1:] for r in results if r[0] == "collector")
    assert [rank for rank, _ in collectors] == [1, 2]
    for _, loads in collectors:
        versions = [v for v, _ in loads]
        assert len(loads) == w.STEPS - 1 and None not in versions
        assert versions == sorted(set(versions)) and set(versions) <= set(published)
        assert all(value == v for v, value in loads), loads  # exactly one broadcast version


def test_periodical_exchange_over_gloo():
    q = mp.get_context("forkserver").SimpleQueue()
    mp.launch(w.gloo_periodical_worker, args=(q,), nprocs=3)
    results = sorted(get(q) for _ in range(3))
    receivers = [steps for kind, _, steps in results if kind == "receiver"]
    assert len(receivers) == 2
    for steps in receivers:
        loads = [loaded for loaded, _, _ in steps if loaded is not None]
        assert len(loads) > 3 and loads == sorted(set(loads))
        assert all(v % 2 == 0 for v in loads)  # the sender's period
        current = -1
        for loaded, stale, value in steps:
            current = loaded if loaded is not None else current
            assert stale == 1 if loaded is not None else stale <= 2
            assert current < 0 or value == current


def test_a_learner_killed_is_a_peer_death_over_gloo():
    """Issue 26: over torch.distributed a receiving thread that failed set ``closed``, so the
    collector's ``while not finished`` loop ended as if the learner had finished."""
    import os
    import signal

    ctx = mp.get_context("fork")
    go, out = ctx.Queue(), ctx.Queue()
    port = _free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = []
    for rank, target, args in ((0, w.dying_learner, (None, None, go, "gloo")),
                               (1, w.collector_until_finished, (None, None, go, out, "gloo"))):
        p = ctx.Process(target=_with_env, args=(dict(env, RANK=str(rank)), target, args))
        p.start()
        procs.append(p)
    try:
        version, ends = out.get(timeout=90)
    finally:
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
    assert [p.exitcode for p in procs] == [-9, 0]
    assert version == 0
    assert [kind for kind, _ in ends] == ["PeerDiedError", "PeerDiedError"], ends


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_env(env, target, args):
    import os

    os.environ.update(env)
    target(*args)
