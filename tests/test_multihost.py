"""Two hosts for real: two network namespaces joined by a veth pair (issue 31).

Each "host" is a namespace with one address (10.231.x.1 and 10.231.x.2, nothing else
routed), running tests/_multihost.py under ``ip netns exec``. The host name still resolves to
the container's own address or a loopback one, which is exactly what breaks gloo without
``GLOO_SOCKET_IFNAME``: no test sets it. Needs root with CAP_NET_ADMIN and ``ip``; skips
with the reason otherwise. Namespaces and every process are removed even when a test fails.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # each test starts two elastic agents and 3-8 workers

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_multihost.py")
PORT = 29511
WAIT_S = 240.0  # a whole program on 2 loaded CPUs (two agents, torch imports, 10 MiB x 20)
DETECT_S = 30.0  # issue 31: a lost host or learner raises on every survivor within this
_serial = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=check)


class TwoHosts:
    """Namespaces ``a`` and ``b`` with a veth pair; ``start`` runs a command in one."""

    def __init__(self, tmp_path) -> None:
        tag = f"{os.getpid() % 100000}{next(_serial)}"
        self.subnet = 231  # the addresses exist only inside the two namespaces
        self.ns = {"a": f"tmxa{tag}", "b": f"tmxb{tag}"}
        self.addr = {"a": f"10.{self.subnet}.0.1", "b": f"10.{self.subnet}.0.2"}
        self.dev = {"a": f"tmxa{tag}v", "b": f"tmxb{tag}v"}
        self.procs: list[subprocess.Popen] = []
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        self.out = tmp_path / "out"
        self.out.mkdir()

    def setup(self) -> None:
        for host in "ab":
            _ip("netns", "add", self.ns[host])
        _ip("link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
        for host in "ab":
            ns, dev = self.ns[host], self.dev[host]
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{self.addr[host]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def start(self, host: str, *argv: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GLOO_SOCKET_")}
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.logs / f"{host}-{len(self.procs)}.log", "w") as log:
            p = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], env=env,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def launch(self, host: str, program: str, nprocs: int, *kv: str) -> subprocess.Popen:
        return self.start(host, sys.executable, SCRIPT, "launch", program,
                          "0" if host == "a" else "1", str(nprocs), self.addr["a"], str(PORT),
                          str(self.out), *kv)

    def kill(self, p: subprocess.Popen) -> None:
        """SIGKILLs the process group of ``p`` (the host's agent and workers)."""
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, p: subprocess.Popen, timeout: float = WAIT_S) -> int:
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.log_text()}") from None

    def results(self, prefix: str) -> dict[str, dict]:
        return {name[len(prefix) + 1:-5]: json.loads((self.out / name).read_text())
                for name in sorted(os.listdir(self.out))
                if name.startswith(prefix + "-") and name.endswith(".json")}

    def wait_for_files(self, prefix: str, count: int, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while len(self.results(prefix)) < count:
            if time.monotonic() > deadline or all(p.poll() is not None for p in self.procs):
                raise AssertionError(f"{len(self.results(prefix))} of {count} {prefix} files "
                                     f"after {timeout} s:\n{self.log_text()}")
            time.sleep(0.1)  # test harness only: waiting on files written in other namespaces

    def log_text(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}"
                         for f in sorted(self.logs.iterdir()))

    def teardown(self) -> None:
        for p in self.procs:
            self.kill(p)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for host in "ab":
            _ip("netns", "del", self.ns[host], check=False)
        # segments of processes killed above: their owners are gone, the reaper frees them
        subprocess.run([sys.executable, "-m", "torch_mp_ext", "cleanup"], capture_output=True,
                       timeout=60, check=False)


def _can_make_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    probe = f"tmxprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()} (CAP_NET_ADMIN missing?)"
    _ip("netns", "del", probe, check=False)
    return None


@pytest.fixture
def hosts(tmp_path):
    reason = _can_make_namespaces()
    if reason:
        pytest.skip(reason)
    two = TwoHosts(tmp_path)
    try:
        two.setup()
        yield two
    finally:
        two.teardown()


def _check_ddp(hosts: TwoHosts, extra: bool) -> None:
    ranks = hosts.results("ddp")
    assert sorted(ranks) == ["0", "1", "2", "3"], hosts.log_text()
    assert {r["sum"] for r in ranks.values()} == {10.0}
    afters = {json.dumps(r["after"]) for r in ranks.values()}
    assert len(afters) == 1  # DDP averaged the gradients: one model on every rank
    assert ranks["0"]["after"] != ranks["0"]["before"]
    assert all(r["elastic"] for r in ranks.values())
    assert {r["ifname"] for r in ranks.values() if r["rank"] < 2} == {hosts.dev["a"]}
    assert {r["ifname"] for r in ranks.values() if r["rank"] >= 2} == {hosts.dev["b"]}
    if extra:
        for r in ranks.values():
            assert r["queue"] == [2.0 * r["rank"]] * 4 and r["loader"] == 28
        assert {tuple(r["exchanged"][:1]) for k, r in ranks.items() if k != "0"} == {(2,)}


def test_launch_two_hosts_all_reduce_and_ddp_without_gloo_socket_ifname(hosts):
    a = hosts.launch("a", "ddp", 2)
    b = hosts.launch("b", "ddp", 2)
    assert (hosts.wait(a), hosts.wait(b)) == (0, 0), hosts.log_text()
    _check_ddp(hosts, extra=False)


def test_the_same_program_under_torchrun(hosts):
    """torchrun's workers: the program, our queues, DataLoader context and exchanger."""
    runs = []
    for host in "ab":
        runs.append(hosts.start(
            host, sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
            "--nproc-per-node=2", f"--node-rank={0 if host == 'a' else 1}",
            f"--master-addr={hosts.addr['a']}", f"--master-port={PORT}",
            f"--local-addr={hosts.addr[host]}", SCRIPT, "torchrun", "ddp", str(hosts.out),
            "extra=1"))
    assert [hosts.wait(p) for p in runs] == [0, 0], hosts.log_text()
    _check_ddp(hosts, extra=True)


def test_max_restarts_survives_a_killed_worker(hosts):
    a = hosts.launch("a", "restart", 2, "launch.max_restarts=1", "launch.rdzv_backend=c10d")
    b = hosts.launch("b", "restart", 2, "launch.max_restarts=1", "launch.rdzv_backend=c10d")
    assert (hosts.wait(a), hosts.wait(b)) == (0, 0), hosts.log_text()
    ranks = hosts.results("restart")
    assert sorted(ranks) == ["0", "1", "2", "3"]
    assert {(r["attempt"], r["sum"]) for r in ranks.values()} == {(1, 4.0)}


def test_hierarchical_exchange_to_two_hosts_of_three_collectors(hosts):
    a = hosts.launch("a", "hierarchical", 2)  # rank 0 learner, rank 1 host a's relay
    b = hosts.launch("b", "hierarchical", 1)  # rank 2: host b's relay
    assert (hosts.wait(a), hosts.wait(b)) == (0, 0), hosts.log_text()
    collectors = hosts.results("collector")
    assert sorted(collectors) == [f"{r}-{i}" for r in (1, 2) for i in range(3)]
    for name, c in collectors.items():
        versions = [v for v, _ in c["reads"]]
        assert c["raised"] is None
        assert all(value == v for v, value in c["reads"]), (name, c["reads"])  # whole ones
        assert versions == sorted(set(versions)) and versions[-1] == 19, (name, versions)
    assert {r["version"] for r in hosts.results("relay").values()} == {19}
    # the learner wrote one copy per host (its own host's relay and the other's), not one
    # per collector (6)
    assert 1.5 < hosts.results("learner")["0"]["copies"] < 2.5


def test_a_killed_host_raises_on_every_survivor(hosts):
    a = hosts.launch("a", "busy", 2)
    b = hosts.launch("b", "busy", 2)
    hosts.wait_for_files("ready", 4)
    killed = time.time()
    hosts.kill(b)
    assert hosts.wait(a, DETECT_S + 10) != 0  # the agent raised ChildFailedError
    raised = hosts.results("raised")
    assert {"0", "1"} <= set(raised), hosts.log_text()
    for rank in "01":
        assert raised[rank]["at"] - killed < DETECT_S, raised[rank]


def test_a_killed_learner_raises_on_every_survivor(hosts):
    a = hosts.launch("a", "hierarchical", 2, "kill_after=5")
    b = hosts.launch("b", "hierarchical", 1, "kill_after=5")
    assert hosts.wait(b, WAIT_S) != 0, hosts.log_text()  # host b's relay raised
    hosts.wait(a)
    killed = hosts.results("killed")["learner"]["at"]
    relay = hosts.results("relay")["2"]
    assert relay["raised"] == "PeerDiedError" and relay["at"] - killed < DETECT_S
    collectors = hosts.results("collector")
    survivors = [f"2-{i}" for i in range(3)]  # host a's went with the agent's group stop
    assert set(survivors) <= set(collectors), hosts.log_text()
    for name in survivors:
        c = collectors[name]
        assert c["raised"] == "PeerDiedError", (name, c)
        assert c["at"] - killed < DETECT_S
        assert all(value == v for v, value in c["reads"])
