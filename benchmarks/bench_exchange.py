"""Model exchange: a learner publishes a ~100 MB state_dict to 3 collector processes.

Measured: the time from just before the learner starts publishing until all three
collectors have the new weights in their models (each collector stamps the moment its load
returned, on the host's monotonic clock, which every process shares). Each contender runs in
its own process tree, started once and kept warm; rounds are interleaved across contenders
(the order rotates), one warm-up round is dropped, cells are medians.

- ``torch_mp_ext``: ``StateDictChannel.publish(model)``; collectors
  ``read_into(model, newer_than=v)``.
- ``torch.mp Queue``: one ``torch.multiprocessing.Queue`` per collector; the learner puts a
  snapshot of its state_dict (``clone()``: the collectors must not alias weights the learner
  keeps training), torch moves it to shared memory and sends fds; collectors
  ``load_state_dict``. Its processes never import torch_mp_ext (whose reducers would replace
  torch's). The *live* row puts ``model.state_dict()`` itself: after the first round those
  storages are torch's shared memory already, so nothing is copied at ``put``, but the
  collectors then read weights the learner is changing (a mix of versions in a real loop).
- ``gloo broadcast``: ``dist.broadcast`` of every tensor, from the learner's rank straight
  into the collectors' parameters (4 ranks on loopback).

Reader cost: ``read_into`` of the newest version (nothing to wait for) against one
single-threaded ``memcpy`` of the same bytes (``ctypes.memmove`` per tensor), in one process
while the others are idle.

    python benchmarks/bench_exchange.py [--repeats 9] [--mbytes 100]

Two hosts (root: two network namespaces joined by a veth pair): flat (every collector a rank
receiving over the network) vs hierarchical (one relay per host, shared memory on it); bytes
the learner sends and time per version (``bench_exchange_hosts.py`` says how):

    sudo python benchmarks/bench_exchange.py --two-hosts [--mbytes 10] [--versions 20]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import bench_json
import torch

COLLECTORS = 3
TIMEOUT = 300.0


def make_model(mbytes: int) -> torch.nn.Module:
    """Linear(2048, 1024) layers: 8 MiB of weights each, ``mbytes`` MB in all."""
    layers = max(1, round(mbytes * 1e6 / (1024 * 2048 * 4)))
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 1024) for _ in range(layers)])


def fill_(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(value)


def holds(model: torch.nn.Module, value: float) -> bool:
    """Spot check: the first, middle and last element of every tensor."""
    for t in model.state_dict().values():
        flat = t.view(-1)
        if not (flat[0] == value and flat[len(flat) // 2] == value and flat[-1] == value):
            return False
    return True


def nbytes_of(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


# ---- the contenders: learner side (the side's main process) and collectors ---------------------


def serve(publish, acks, close) -> None:
    """The learner's command loop on stdin: ``round v`` -> JSON line with the timing."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "round":
            v = int(arg[0])
            t0 = publish(v)
            got = [acks.get(timeout=TIMEOUT) for _ in range(COLLECTORS)]
            print(json.dumps({"s": max(t for t, _ in got) - t0, "ok": all(ok for _, ok in got)}),
                  flush=True)
        elif cmd == "reader_cost":
            print(json.dumps(reader_cost(int(arg[0]))), flush=True)
        else:
            break
    close()


def tmx_collector(ch, acks, mbytes: int) -> None:
    model = make_model(mbytes)
    v = -1
    while True:
        try:
            v = ch.read_into(model, newer_than=v, timeout=TIMEOUT)
        except EOFError:  # ChannelClosedError
            return
        acks.put((time.monotonic(), holds(model, v)))


_tmx: dict = {}


def tmx_side(mbytes: int) -> None:
    import torch_mp_ext as mp

    ctx = mp.get_context("spawn")
    model = make_model(mbytes)
    ch = mp.StateDictChannel(model)
    acks = ctx.Queue()
    procs = [ctx.Process(target=tmx_collector, args=(ch, acks, mbytes)) for _ in range(COLLECTORS)]
    for p in procs:
        p.start()
    _tmx.update(ch=ch, model=model, mbytes=mbytes)

    def publish(v):
        fill_(model, v)
        t0 = time.monotonic()
        ch.publish(model, v)
        return t0

    def close():
        ch.close()
        for p in procs:
            p.join(60)

    serve(publish, acks, close)


def reader_cost(reps: int) -> dict:
    ch, mbytes = _tmx["ch"], _tmx["mbytes"]
    dst, src = make_model(mbytes), make_model(mbytes)
    pairs = [(d.data_ptr(), s.data_ptr(), d.numel() * d.element_size())
             for d, s in zip(dst.state_dict().values(), src.state_dict().values())]
    read_s, memcpy_s = [], []
    ch.read_into(dst, timeout=TIMEOUT)  # warm: pages of dst and of the mapping faulted in
    for _ in range(reps):
        start = time.perf_counter()
        ch.read_into(dst, timeout=0)
        read_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        for d, s, n in pairs:
            ctypes.memmove(d, s, n)
        memcpy_s.append(time.perf_counter() - start)
    return {"read": statistics.median(read_s), "memcpy": statistics.median(memcpy_s)}


def torch_collector(q, acks, mbytes: int) -> None:
    model = make_model(mbytes)
    while True:
        item = q.get(timeout=TIMEOUT)
        if item is None:
            return
        v, state = item
        model.load_state_dict(state)
        t1 = time.monotonic()
        del state, item
        acks.put((t1, holds(model, v)))


def torch_side(mbytes: int, live: bool) -> None:
    if "torch_mp_ext" in sys.modules:
        raise RuntimeError("the torch.multiprocessing side must not import torch_mp_ext")
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    model = make_model(mbytes)
    queues = [ctx.Queue() for _ in range(COLLECTORS)]
    acks = ctx.Queue()
    procs = [ctx.Process(target=torch_collector, args=(q, acks, mbytes)) for q in queues]
    for p in procs:
        p.start()

    def publish(v):
        fill_(model, v)
        t0 = time.monotonic()
        state = model.state_dict()
        if not live:
            state = {k: t.clone() for k, t in state.items()}
        for q in queues:
            q.put((v, state))
        return t0

    def close():
        for q in queues:
            q.put(None)
        for p in procs:
            p.join(60)

    serve(publish, acks, close)


def gloo_collector(rank: int, env: dict, acks, mbytes: int) -> None:
    import torch.distributed as dist

    os.environ.update(env, RANK=str(rank))
    dist.init_process_group("gloo")
    model = make_model(mbytes)
    tensors = list(model.state_dict().values())
    header = torch.zeros(1, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0)
        v = int(header[0])
        if v < 0:
            break
        for t in tensors:
            dist.broadcast(t, src=0)
        acks.put((time.monotonic(), holds(model, v)))
    dist.destroy_process_group()


def gloo_side(mbytes: int) -> None:
    import socket

    import torch.distributed as dist
    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(COLLECTORS + 1)}
    ctx = tmp.get_context("spawn")
    acks = ctx.Queue()
    procs = [ctx.Process(target=gloo_collector, args=(r, env, acks, mbytes))
             for r in range(1, COLLECTORS + 1)]
    for p in procs:
        p.start()
    os.environ.update(env, RANK="0")
    dist.init_process_group("gloo")
    model = make_model(mbytes)
    tensors = list(model.state_dict().values())

    def publish(v):
        fill_(model, v)
        t0 = time.monotonic()
        dist.broadcast(torch.tensor([v]), src=0)
        for t in tensors:
            dist.broadcast(t, src=0)
        return t0

    def close():
        dist.broadcast(torch.tensor([-1]), src=0)
        for p in procs:
            p.join(60)
        dist.destroy_process_group()

    serve(publish, acks, close)


# ---- the driver -------------------------------------------------------------------------------

SIDES = {
    "torch_mp_ext": ["tmx"],
    "torch.mp Queue (snapshot)": ["torch"],
    "torch.mp Queue (live, unsafe)": ["torch", "--live"],
    "gloo broadcast": ["gloo"],
}


def start(args: list[str], mbytes: int) -> subprocess.Popen:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    if args[0] == "tmx":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--side", *args,
                          "--mbytes", str(mbytes)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    return p


def ask(p: subprocess.Popen, line: str) -> dict:
    p.stdin.write(line + "\n")
    p.stdin.flush()
    out = p.stdout.readline()
    if not out:
        raise RuntimeError(f"a benchmark side died (exit code {p.wait()})")
    return json.loads(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--mbytes", type=int, default=100)
    parser.add_argument("--side", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--live", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--two-hosts", action="store_true",
                        help="the two-host rows instead (root: network namespaces)")
    parser.add_argument("--versions", type=int, default=20, help="two hosts: versions sent")
    parser.add_argument("--collectors", type=int, default=COLLECTORS,
                        help="two hosts: collectors per host")
    parser.add_argument("--pause", type=float, default=0.5,
                        help="two hosts: seconds between versions")
    bench_json.add_argument(parser)
    args = parser.parse_args()
    if args.two_hosts:
        import bench_exchange_hosts

        rows = bench_exchange_hosts.two_hosts(args)
        if args.json:
            bench_json.write(args.json, "bench_exchange", rows,
                             params={"mbytes": args.mbytes, "versions": args.versions,
                                     "collectors": args.collectors, "pause": args.pause},
                             rows_doc="two hosts: learner bytes, a->b bytes and seconds until "
                                      "every collector loaded a version, per exchange")
        return 0
    if args.side:
        kind = args.side[0]
        {"tmx": lambda: tmx_side(args.mbytes),
         "torch": lambda: torch_side(args.mbytes, "--live" in args.side),
         "gloo": lambda: gloo_side(args.mbytes)}[kind]()
        return 0

    nbytes = nbytes_of(make_model(args.mbytes))
    print(f"Model exchange: a {nbytes / 1e6:.0f} MB state_dict ({len(make_model(args.mbytes))} "
          f"Linear(2048, 1024)) from a learner to {COLLECTORS} collectors, until all have "
          f"loaded it: median of {args.repeats}, ms")
    print(f"Python {platform.python_version()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {platform.machine()}")
    procs = {name: start(side, args.mbytes) for name, side in SIDES.items()}
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    wrong = []
    try:
        for name, p in procs.items():
            if not json.loads(p.stdout.readline()).get("ready"):
                raise RuntimeError(f"{name} did not start")
        names = list(SIDES)
        for r in range(args.repeats + 1):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                res = ask(procs[name], f"round {r}")
                if not res["ok"]:
                    wrong.append((name, r))
                if r:  # round 0 warms up
                    times[name].append(res["s"])
            print(f"round {r}/{args.repeats}", file=sys.stderr, flush=True)
        cost = ask(procs["torch_mp_ext"], "reader_cost 15")
    finally:
        for p in procs.values():
            try:
                p.stdin.write("quit\n")
                p.stdin.close()
            except OSError:
                pass
            p.wait(120)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ours = med["torch_mp_ext"]
    print()
    print("| contender | median ms | min ms | max ms | vs torch_mp_ext |")
    print("|-----------|-----------|--------|--------|-----------------|")
    for name, ts in times.items():
        print(f"| {name} | {med[name] * 1e3:.1f} | {min(ts) * 1e3:.1f} | {max(ts) * 1e3:.1f} | "
              f"{med[name] / ours:.1f}x |")
    ratio = cost["read"] / cost["memcpy"]
    print(f"\nreader cost: read_into {cost['read'] * 1e3:.1f} ms, one memcpy "
          f"{cost['memcpy'] * 1e3:.1f} ms: {ratio:.2f}x (target <= 3x) "
          f"{'PASS' if ratio <= 3 else 'MISS'}")
    queue = med["torch.mp Queue (snapshot)"] / ours
    gloo = med["gloo broadcast"] / ours
    print(f"torch.mp Queue (snapshot) / torch_mp_ext: {queue:.1f}x (target >= 5x) "
          f"{'PASS' if queue >= 5 else 'MISS'}")
    print(f"gloo broadcast / torch_mp_ext: {gloo:.1f}x (target >= 2x) "
          f"{'PASS' if gloo >= 2 else 'MISS'}")
    if args.json:
        rows = [{"series": name, "nbytes": nbytes, "median_s": med[name], "samples_s": ts}
                for name, ts in times.items()]
        rows.append({"series": "torch_mp_ext read_into (one reader)", "nbytes": nbytes,
                     "median_s": cost["read"]})
        rows.append({"series": "memcpy floor", "floor": True, "nbytes": nbytes,
                     "median_s": cost["memcpy"]})
        bench_json.write(args.json, "bench_exchange", rows,
                         params={"repeats": args.repeats, "mbytes": args.mbytes,
                                 "collectors": COLLECTORS, "wrong": wrong},
                         rows_doc="seconds until every collector has loaded a published "
                                  "state_dict, per contender")
    if wrong:
        print(f"WRONG WEIGHTS LOADED: {wrong}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
