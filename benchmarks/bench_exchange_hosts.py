"""The two-host rows of bench_exchange.py: flat vs hierarchical exchange across two hosts.

Two "hosts" are two network namespaces joined by a veth pair (root needed; both removed at
the end), each running ``torch_mp_ext.launch`` for its ranks; gloo carries the learner's
broadcast between them. The learner publishes ``--versions`` versions of an ``--mbytes`` MiB
state_dict, one every ``--pause`` seconds (so each is delivered alone), to
``--collectors`` collectors on each host:

- ``flat``: every collector is a rank and receives the broadcast (``ModelExchanger(...,
  backend="gloo")``): host a runs the learner and its collectors, host b its collectors;
- ``hierarchical``: one :class:`~torch_mp_ext.exchange.HostRelay` rank per host receives
  it and republishes through a StateDictChannel its collectors (processes it started) read.

Measured per version: the bytes the learner process wrote (``/proc/self/io`` ``wchar``
around ``send()``), the bytes that crossed from host a to host b (the veth's ``tx_bytes``
over the run, divided by the versions), and the time from the start of ``send()`` until the
last collector of both hosts had loaded it (every process reads the one CLOCK_MONOTONIC of
the kernel both namespaces share). The first two versions warm up and are dropped.

    sudo python benchmarks/bench_exchange.py --two-hosts [--mbytes 10] [--versions 20]
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

WARMUP = 2
PORT = 29531


def make_model(mbytes: int) -> torch.nn.Module:
    n = mbytes * 2**20 // 4
    layers = [torch.nn.Linear(1024, 1024, bias=False) for _ in range(n // 2**20)]
    if n % 2**20:
        layers.append(torch.nn.Linear(1024, (n % 2**20) // 1024, bias=False))
    return torch.nn.Sequential(*layers)


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _write(outdir: str, name: str, value: object) -> None:
    path = os.path.join(outdir, name + ".json")
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.rename(path + ".tmp", path)


def _collect(ex, model) -> list:
    loads = []
    while True:
        v = ex.receive(timeout=60)
        if v is not None:
            loads.append((v, time.monotonic()))
        elif ex.finished:
            return loads


def _collector_process(channel, mbytes: int, outdir: str, name: str) -> None:
    from torch_mp_ext.exchange import ModelExchanger

    model = make_model(mbytes)
    _write(outdir, f"collector-{name}",
           _collect(ModelExchanger(model, role="collector", channel=channel), model))


def rank_main(local_rank: int, mode: str, outdir: str, mbytes: int, versions: int,
              collectors: int, pause: float) -> None:
    import torch.distributed as dist

    import torch_mp_ext as mp
    from torch_mp_ext.exchange import HostRelay, ModelExchanger

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    model = make_model(mbytes)
    if rank == 0:
        ex = ModelExchanger(model, role="learner", backend="gloo")
        dist.barrier()
        rows = []
        for v in range(versions):
            with torch.no_grad():
                for t in model.state_dict().values():
                    t.fill_(v)
            w0, t0 = _wchar(), time.monotonic()
            ex.send()
            rows.append({"version": v, "t0": t0, "bytes": _wchar() - w0})
            time.sleep(pause)
        ex.close()
        _write(outdir, "learner", rows)
    elif mode == "flat":
        ex = ModelExchanger(model, role="collector", backend="gloo", timeout=60)
        dist.barrier()
        _write(outdir, f"collector-{rank}", _collect(ex, model))
        ex.close()
    else:
        relay = HostRelay(model)
        ctx = mp.get_context("forkserver")
        procs = [ctx.Process(target=_collector_process,
                             args=(relay.channel, mbytes, outdir, f"{rank}-{i}"))
                 for i in range(collectors)]
        for p in procs:
            p.start()
        dist.barrier()
        relay.join()
        for p in procs:
            p.join(60)
        relay.close()
    dist.destroy_process_group()


def _load(path: str) -> object:
    with open(path) as f:
        return json.load(f)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=check)


def _tx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat",
                          f"/sys/class/net/{dev}/statistics/tx_bytes"],
                         capture_output=True, text=True, timeout=30, check=True)
    return int(out.stdout)


def run_mode(mode: str, args) -> dict:
    """One run of ``mode`` across fresh namespaces; the row's numbers."""
    tag = f"{os.getpid() % 100000}"
    ns = {"a": f"tmxba{tag}", "b": f"tmxbb{tag}"}
    dev = {"a": f"tmxba{tag}v", "b": f"tmxbb{tag}v"}
    addr = {"a": "10.232.0.1", "b": "10.232.0.2"}
    c = args.collectors
    nprocs = {"a": 1 + c, "b": c} if mode == "flat" else {"a": 2, "b": 1}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as outdir:
        try:
            for host in "ab":
                _ip("netns", "add", ns[host])
            _ip("link", "add", dev["a"], "type", "veth", "peer", "name", dev["b"])
            for host in "ab":
                _ip("link", "set", dev[host], "netns", ns[host])
                _ip("-n", ns[host], "addr", "add", f"{addr[host]}/24", "dev", dev[host])
                _ip("-n", ns[host], "link", "set", dev[host], "up")
                _ip("-n", ns[host], "link", "set", "lo", "up")
            tx0 = _tx_bytes(ns["a"], dev["a"])
            for node, host in enumerate("ab"):
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns[host], sys.executable, os.path.abspath(__file__),
                     "--side", mode, str(node), str(nprocs[host]), addr["a"], outdir,
                     str(args.mbytes), str(args.versions), str(c), str(args.pause)],
                    start_new_session=True))
            for p in procs:
                if p.wait(600) != 0:
                    raise RuntimeError(f"the {mode} run failed (exit code {p.returncode})")
            tx = _tx_bytes(ns["a"], dev["a"]) - tx0
            learner = _load(os.path.join(outdir, "learner.json"))
            loads = [_load(os.path.join(outdir, name))
                     for name in os.listdir(outdir) if name.startswith("collector-")]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait(30)
            for host in "ab":
                _ip("netns", "del", ns[host], check=False)
    if len(loads) != 2 * c:
        raise RuntimeError(f"{len(loads)} of {2 * c} collectors reported")
    latencies = []
    for row in learner[WARMUP:]:
        got = [t for load in loads for v, t in load if v == row["version"]]
        if len(got) == len(loads):  # every collector loaded this version
            latencies.append(max(got) - row["t0"])
    if not latencies:
        raise RuntimeError(f"{mode}: no version reached every collector (raise --pause)")
    return {"series": f"two hosts, {mode}", "collectors_per_host": c,
            "learner_bytes_per_version": statistics.median(r["bytes"] for r in learner[WARMUP:]),
            "cross_host_bytes_per_version": tx / args.versions,
            "median_s": statistics.median(latencies),
            "versions_seen_by_all": len(latencies)}


def two_hosts(args) -> list[dict]:
    """Runs both modes, prints the table, returns the rows."""
    if os.geteuid() != 0:
        raise SystemExit("--two-hosts makes network namespaces: run it as root")
    nbytes = sum(t.numel() * t.element_size() for t in make_model(args.mbytes).state_dict()
                 .values())
    rows = [run_mode(mode, args) for mode in ("flat", "hierarchical")]
    print(f"\nTwo hosts (veth pair), {args.collectors} collectors per host, a "
          f"{nbytes / 2**20:.0f} MiB state_dict, {args.versions} versions (first {WARMUP} "
          "dropped)")
    print("| exchange | learner bytes / version | a->b bytes / version | copies of the "
          "state_dict sent by the learner | median ms per version |")
    print("|---|---|---|---|---|")
    for r in rows:
        ms = f"{r['median_s'] * 1e3:.0f}"
        print(f"| {r['series']} | {r['learner_bytes_per_version'] / 2**20:.1f} MiB | "
              f"{r['cross_host_bytes_per_version'] / 2**20:.1f} MiB | "
              f"{r['learner_bytes_per_version'] / nbytes:.1f} | {ms} |")
    for r in rows:
        r["nbytes"] = nbytes
    return rows


def side_main(argv: list[str]) -> None:
    import torch_mp_ext as mp

    mode, node, nprocs, addr, outdir, mbytes, versions, collectors, pause = argv
    mp.launch(rank_main, args=(mode, outdir, int(mbytes), int(versions), int(collectors),
                               float(pause)),
              nprocs=int(nprocs), nnodes=2, node_rank=int(node), master_addr=addr,
              master_port=PORT)


if __name__ == "__main__":
    side_main(sys.argv[2:])
