"""The programs of test_multihost.py: one "host" each, run inside a network namespace.

    python tests/_multihost.py launch PROGRAM NODE_RANK NPROCS MASTER_ADDR PORT OUTDIR [K=V...]
    python -m torch.distributed.run ... tests/_multihost.py torchrun PROGRAM OUTDIR [K=V...]

Every worker writes what the test checks as one JSON file in OUTDIR (``<what>-<rank>.json``,
written to a temporary name and renamed, so a file the test sees is whole).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import torch_mp_ext as mp
from torch_mp_ext.errors import PeerDiedError
from torch_mp_ext.exchange import HostRelay, ModelExchanger

TIMEOUT = datetime.timedelta(seconds=60)


def write(outdir: str, name: str, value: object) -> None:
    path = os.path.join(outdir, name + ".json")
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.rename(path + ".tmp", path)


def _double(q_in, q_out):
    q_out.put(q_in.get(timeout=60) * 2)


def extras(rank: int) -> dict:
    """torch_mp_ext's queues, processes and DataLoader context inside this worker."""
    ctx = mp.get_context("forkserver")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_double, args=(q_in, q_out))
    p.start()
    q_in.put(torch.full((4,), float(rank)))
    doubled = q_out.get(timeout=60).tolist()
    p.join(60)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=2,
                                         multiprocessing_context=ctx)
    return {"queue": doubled, "loader": sum(int(b.sum()) for b in loader)}


def ddp(local_rank: int, outdir: str, extra: str = "0") -> None:
    """all_reduce, one DDP step, and (``extra=1``) an exchange and our queues/DataLoader."""
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    before = [p.detach().clone().flatten().tolist() for p in model.parameters()]
    net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)
    net(torch.randn(16, 8)).pow(2).sum().backward()
    opt.step()
    out = {"rank": rank, "world": world, "sum": t.item(), "before": before,
           "after": [p.detach().flatten().tolist() for p in model.parameters()],
           "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
           "elastic": dist.is_torchelastic_launched()}
    if extra == "1":
        out.update(extras(rank))
        ex = ModelExchanger(model, role="learner" if rank == 0 else "collector",
                            backend="gloo", timeout=60)
        if rank == 0:
            for v in range(3):
                with torch.no_grad():
                    for p in model.parameters():
                        p.fill_(v)
                ex.send()
            ex.close()
        else:
            while not ex.finished:
                ex.receive(timeout=5)
            ex.close()
            out["exchanged"] = [ex.version, model.weight.flatten().tolist()[:2]]
    write(outdir, f"ddp-{rank}", out)
    dist.barrier()
    dist.destroy_process_group()


def restart(local_rank: int, outdir: str) -> None:
    """Attempt 0: the last rank kills itself after the first all_reduce; attempt 1 runs."""
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(5):
        t = torch.ones(1)
        dist.all_reduce(t)
        if attempt == 0 and rank == world - 1 and step == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.2)
    write(outdir, f"restart-{rank}", {"attempt": attempt, "sum": t.item()})
    dist.barrier()
    dist.destroy_process_group()


def busy(local_rank: int, outdir: str) -> None:
    """all_reduce until the other host goes; records what this rank raised, and when."""
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank = dist.get_rank()
    try:
        for step in range(3000):
            dist.all_reduce(torch.ones(1))
            if step == 0:
                write(outdir, f"ready-{rank}", {"pid": os.getpid()})
            time.sleep(0.05)
    except Exception as exc:
        write(outdir, f"raised-{rank}", {"type": type(exc).__name__, "at": time.time(),
                                         "text": str(exc)[:500]})
        raise


def _wchar() -> int:
    """Bytes this process passed to write calls (sockets included): /proc/self/io."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _collector(channel, mbytes: int, outdir: str, name: str) -> None:
    model = make_model(mbytes)
    ex = ModelExchanger(model, role="collector", channel=channel, timeout=60)
    reads = []
    try:
        while True:
            v = ex.receive()
            if v is not None:
                reads.append([v, whole_version(model)])
            elif ex.finished:
                break
    except PeerDiedError as exc:
        write(outdir, f"collector-{name}", {"reads": reads, "raised": "PeerDiedError",
                                            "at": time.time(), "text": str(exc)[:500]})
        return
    write(outdir, f"collector-{name}", {"reads": reads, "raised": None})


def make_model(mbytes: int) -> torch.nn.Module:
    """``mbytes`` MiB of float32 weights, in Linear(1024, 1024) layers (4 MiB each) and one
    smaller layer for the rest."""
    n = mbytes * 2**20 // 4
    layers = [torch.nn.Linear(1024, 1024, bias=False) for _ in range(n // 2**20)]
    if n % 2**20:
        layers.append(torch.nn.Linear(1024, (n % 2**20) // 1024, bias=False))
    return torch.nn.Sequential(*layers)


def whole_version(model: torch.nn.Module) -> float | None:
    """The one value every weight holds, or None for a mix of versions."""
    values = {float(t.min()) for t in model.state_dict().values()} | {
        float(t.max()) for t in model.state_dict().values()}
    return values.pop() if len(values) == 1 else None


def hierarchical(local_rank: int, outdir: str, versions: str = "20", mbytes: str = "10",
                 kill_after: str = "-1") -> None:
    """Rank 0 learns; every other rank is its host's relay for 3 collectors."""
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank = dist.get_rank()
    model = make_model(int(mbytes))
    if rank == 0:
        ex = ModelExchanger(model, role="learner", backend="gloo")
        dist.barrier()  # every relay's collectors are running
        sent = []
        for v in range(int(versions)):
            with torch.no_grad():
                for t in model.state_dict().values():
                    t.fill_(v)
            before = _wchar()
            ex.send()
            sent.append(_wchar() - before)
            if v == int(kill_after):
                write(outdir, "killed-learner", {"at": time.time()})
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.1)
        ex.close()
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        write(outdir, "learner-0", {"copies": sorted(sent)[len(sent) // 2] / nbytes})
    else:
        relay = HostRelay(model)
        ctx = mp.get_context("forkserver")
        procs = [ctx.Process(target=_collector, args=(relay.channel, int(mbytes), outdir,
                                                      f"{rank}-{i}")) for i in range(3)]
        for p in procs:
            p.start()
        dist.barrier()
        try:
            relay.join(timeout=300)
        except PeerDiedError as exc:
            write(outdir, f"relay-{rank}", {"raised": "PeerDiedError", "at": time.time(),
                                            "text": str(exc)[:500]})
            for p in procs:
                p.join(60)  # the collectors see it too before this rank ends
            raise
        for p in procs:
            p.join(60)
        relay.close()
        write(outdir, f"relay-{rank}", {"raised": None, "version": relay.version})
    dist.destroy_process_group()


PROGRAMS = {"ddp": ddp, "restart": restart, "busy": busy, "hierarchical": hierarchical}


def _kv(items: list[str]) -> dict:
    return dict(item.split("=", 1) for item in items)


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "torchrun":  # run by torchrun's agent: one worker, torchrun's environment
        program, outdir, kwargs = argv[1], argv[2], _kv(argv[3:])
        mp.set_gloo_socket_ifname()  # what launch() does for its workers
        PROGRAMS[program](int(os.environ["LOCAL_RANK"]), outdir, **kwargs)
        return 0
    program, node_rank, nprocs, addr, port, outdir = argv[1:7]
    kwargs = _kv(argv[7:])
    extra = {k[len("launch."):]: int(v) if v.isdigit() else v for k, v in kwargs.items()
             if k.startswith("launch.")}
    for k in list(kwargs):
        if k.startswith("launch."):
            del kwargs[k]
    mp.launch(PROGRAMS[program], args=(outdir,), kwargs=kwargs, nprocs=int(nprocs), nnodes=2,
              node_rank=int(node_rank), master_addr=addr, master_port=int(port), **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
