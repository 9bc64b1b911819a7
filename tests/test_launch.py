"""launch(): torch.distributed workers through torch.distributed.elastic, on loopback.

The two-machine cases across real network namespaces are in test_multihost.py (slow tier).
"""

from __future__ import annotations

import glob
import logging
import multiprocessing.forkserver
import os
import signal
import socket
from pathlib import Path

import _spawn_workers as w
import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import torch_mp_ext as mp
from torch_mp_ext.processes.launch import free_port
from torch_mp_ext.processes.netif import (
    interface_for,
    is_loopback,
    set_gloo_socket_ifname,
    source_address,
)

TIMEOUT = 90.0
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


class _TextOnly(logging.Filter):
    """Turns a record's exception into text: its traceback's frames would hold the agent's
    store and the workers' pipes for as long as pytest keeps the record (past the leak
    check)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        return True


@pytest.fixture(autouse=True)
def _agent_logs_as_text():
    import torch.distributed.elastic.multiprocessing.api  # noqa: F401  (its loggers exist)

    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith("torch.distributed.elastic")]
    text = _TextOnly()
    for logger in loggers:
        logger.addFilter(text)
    yield
    for logger in loggers:
        logger.removeFilter(text)


def test_gloo_all_reduce_across_three_local_workers(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    handler = signal.getsignal(signal.SIGTERM)
    results = mp.launch(w.all_reduce, nprocs=3)
    assert sorted(results) == [0, 1, 2]
    assert [results[r][:4] for r in range(3)] == [(r, 3, 6.0, True) for r in range(3)]
    envs = [results[r][4] for r in range(3)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) for e in envs] == [
        ("0", "0", "0"), ("1", "1", "0"), ("2", "2", "0")]
    assert {(e["MASTER_ADDR"], e["WORLD_SIZE"], e["GROUP_WORLD_SIZE"], e["ROLE_NAME"],
             e["TORCHELASTIC_RUN_ID"], e["TORCHELASTIC_RESTART_COUNT"],
             e["OMP_NUM_THREADS"]) for e in envs} == {
        ("127.0.0.1", "3", "1", "default", "none", "0", "1")}
    # torchrun's defaults are the workers', not the caller's: nothing changed here
    assert "OMP_NUM_THREADS" not in os.environ
    assert signal.getsignal(signal.SIGTERM) is handler
    # nor does the standard library's forkserver the agent started outlive the call
    assert multiprocessing.forkserver._forkserver._forkserver_pid is None


def test_two_machines_on_loopback_form_one_group(monkeypatch):
    # two agents in threads of one process: what each saves and restores of the environment
    # must already be set, or the later restore would undo the earlier one
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    port = free_port()
    nodes = [mp.launch(w.all_reduce, nprocs=2, nnodes=2, node_rank=node, master_addr="127.0.0.1",
                       master_port=port, join=False, start_method="fork") for node in (0, 1)]
    for node in nodes:
        assert node.join(TIMEOUT)
    merged = {**nodes[0].return_values, **nodes[1].return_values}
    assert sorted(merged) == [0, 1, 2, 3]
    assert {merged[r][2] for r in merged} == {10.0}
    assert [(merged[r][4]["LOCAL_RANK"], merged[r][4]["GROUP_RANK"]) for r in range(4)] == [
        ("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")]


def test_lambda_entry_point_and_kwargs():
    results = mp.launch(lambda rank, scale=1: rank * scale, nprocs=2, kwargs={"scale": 10})
    assert results == {0: 0, 1: 10}


def test_a_failure_raises_childfailederror_naming_the_root_cause():
    with pytest.raises(ChildFailedError) as info:
        mp.launch(w.fail_first_attempt, args=("the first attempt fails",), nprocs=2)
    assert "the first attempt fails" in str(info.value)
    assert 1 in info.value.failures


@pytest.mark.slow  # two attempts of the group: elastic's stop, rendezvous and start again
def test_max_restarts_restarts_the_group():
    results = mp.launch(w.fail_first_attempt, args=("first attempt",), nprocs=2, max_restarts=1)
    assert results == {0: 1, 1: 1}


@pytest.mark.slow  # elastic membership: the c10d rendezvous's rounds
def test_elastic_node_count_over_c10d():
    results = mp.launch(w.all_reduce, nprocs=2, nnodes="1:2", rdzv_backend="c10d",
                        rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="elastic-test",
                        rdzv_conf={"last_call_timeout": 1})
    assert sorted(results) == [0, 1]
    assert {results[r][4]["GROUP_WORLD_SIZE"] for r in results} == {"1"}  # one node came
    assert {results[r][2] for r in results} == {3.0}


@pytest.mark.slow  # per-rank log files: elastic's redirection, one more group start
def test_redirects_write_per_rank_logs(tmp_path):
    mp.launch(w.print_rank, nprocs=2, log_dir=str(tmp_path), redirects=3)
    for rank in (0, 1):
        (out,) = glob.glob(str(tmp_path / "*" / "attempt_0" / str(rank) / "stdout.log"))
        (err,) = glob.glob(str(tmp_path / "*" / "attempt_0" / str(rank) / "stderr.log"))
        assert f"stdout of rank {rank}" in Path(out).read_text()
        assert f"stderr of rank {rank}" in Path(err).read_text()


def test_bad_arguments_are_value_errors(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="master_addr"):
        mp.launch(w.succeed, nprocs=1, nnodes=2, node_rank=0)
    with pytest.raises(ValueError, match="node_rank"):
        mp.launch(w.succeed, nprocs=1, nnodes=2, node_rank=2, master_addr="h", master_port=1)
    with pytest.raises(ValueError, match="nprocs"):
        mp.launch(w.succeed, nprocs=0)
    with pytest.raises(ValueError, match="c10d"):
        mp.launch(w.succeed, nnodes="1:2", master_addr="h", master_port=1)
    with pytest.raises(ValueError, match="nnodes"):
        mp.launch(w.succeed, nnodes="two")
    with pytest.raises(ValueError, match="daemon"):
        mp.launch(w.succeed, daemon=True)
    with pytest.raises(ValueError, match="redirects"):
        mp.launch(w.succeed, redirects="stdout")


def test_gloo_interface_is_left_alone_on_one_machine(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFADDR", raising=False)
    assert interface_for("127.0.0.1") is None
    assert set_gloo_socket_ifname("127.0.0.1") is None
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert set_gloo_socket_ifname("10.0.0.1") == "eth7"  # the user's choice stands


def test_gloo_interface_is_the_one_that_routes_to_the_master(monkeypatch):
    master = "192.0.2.1"  # TEST-NET-1: a UDP connect only looks the route up, sends nothing
    src = source_address(master)
    if src is None or is_loopback(src):
        pytest.skip("no route off this machine")
    name = interface_for(master)
    assert name in {n for _, n in socket.if_nameindex()}
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFADDR", raising=False)
    monkeypatch.setenv("MASTER_ADDR", master)
    assert set_gloo_socket_ifname() == name == os.environ["GLOO_SOCKET_IFNAME"]
