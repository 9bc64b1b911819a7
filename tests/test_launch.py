"""launch(): local workers ready for torch.distributed, tested with a real gloo all_reduce."""

from __future__ import annotations

import _spawn_workers as w
import pytest
from test_spawn import get, join_within

import torch_mp_ext as mp
from torch_mp_ext.processes.launch import free_port


def test_gloo_all_reduce_across_three_local_workers():
    q = mp.get_context("forkserver").SimpleQueue()
    join_within(mp.launch(w.all_reduce, args=(q,), nprocs=3, join=False))
    results = sorted(get(q) for _ in range(3))
    assert [(rank, world, value) for rank, world, value, _ in results] == [
        (0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]
    envs = [env for *_, env in results]
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"]) for e in envs} == {
        ("127.0.0.1", envs[0]["MASTER_PORT"], "3")}


def test_ranks_of_the_second_of_two_machines():
    q = mp.get_context("fork").SimpleQueue()
    port = free_port()
    join_within(mp.launch(w.dist_env, args=(q,), nprocs=2, nnodes=2, node_rank=1,
                          master_addr="10.1.2.3", master_port=port, join=False,
                          start_method="fork"))
    envs = sorted((get(q) for _ in range(2)), key=lambda e: e["RANK"])
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) for e in envs] == [
        ("2", "0", "1"), ("3", "1", "1")]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"])
            for e in envs} == {("4", "2", "10.1.2.3", str(port))}


def test_bad_arguments_are_value_errors(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="master_addr"):
        mp.launch(w.succeed, nprocs=1, nnodes=2, node_rank=0)
    with pytest.raises(ValueError, match="node_rank"):
        mp.launch(w.succeed, nprocs=1, nnodes=2, node_rank=2, master_addr="h", master_port=1)
    with pytest.raises(ValueError, match="nprocs"):
        mp.launch(w.succeed, nprocs=0)
