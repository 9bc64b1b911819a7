"""The exchangers over torch.distributed: three gloo ranks on loopback, for real."""

from __future__ import annotations

import _exchange_workers as w
import pytest
import torch.distributed as dist
from test_spawn import get, join_within

import torch_mp_ext as mp

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def test_learner_and_two_collectors_over_gloo():
    q = mp.get_context("forkserver").SimpleQueue()
    join_within(mp.launch(w.gloo_worker, args=(q,), nprocs=3, join=False))
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
