"""Model exchange: a learner publishes a state_dict to N collector processes.

Measured: the time per version, from just before the learner starts publishing until every
collector has the new version in its model (each collector stamps the moment its load
returned, on the host's monotonic clock, which every process shares, into a shared array and
counts itself in, the last one waking the learner; it checks the weights only after the
clock stopped: ``Acks``). For each state size
(``--mbytes``) and number of collectors (``--collectors``), each contender runs in its own
process tree, started once and kept warm; rounds are interleaved across contenders (the order
rotates), one warm-up round is dropped, cells are medians.

- ``tmx copy``: ``StateDictChannel.publish(model)``; collectors ``read_into(model,
  newer_than=v)`` (one copy per collector).
- ``tmx zero-copy``: the same publish; collectors ``borrow_into(model, newer_than=v)``: the
  model's parameters become views of the published version (no copy; the channel's default
  3 buffers, since every collector borrows the newest version).
- ``torch.mp Queue (snapshot)``: one ``torch.multiprocessing.Queue`` per collector; the
  learner puts a snapshot of its state_dict (``clone()``: the collectors must not alias
  weights the learner keeps training), torch moves it to shared memory and sends fds;
  collectors ``load_state_dict``. Its processes never import torch_mp_ext (whose reducers
  would replace torch's).
- ``gloo broadcast``: ``dist.broadcast`` of every tensor, from the learner's rank straight
  into the collectors' parameters (N + 1 ranks on loopback).
- floors, per size: ``publish`` (the learner's ``ch.publish``: one memcpy of the state into
  the channel, timed in the zero-copy rounds) and ``memcpy`` (one single-threaded
  ``ctypes.memmove`` per tensor between two private models, learner idle).

A configuration whose processes would not fit in memory together (estimated per contender,
against MemAvailable and free /dev/shm) runs its contenders one at a time; a contender that
does not fit alone is skipped and says so.

    python benchmarks/bench_exchange.py [--repeats 9] [--mbytes 100,1000]
                                        [--collectors 1,3,8,16] [--only zero-copy,copy,...]

Two hosts (root: two network namespaces joined by a veth pair): flat (every collector a rank
receiving over the network) vs hierarchical (one relay per host, shared memory on it); bytes
the learner sends and time per version (``bench_exchange_hosts.py`` says how):

    sudo python benchmarks/bench_exchange.py --two-hosts [--mbytes 10] [--versions 20]
                                             [--collectors 3]
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

TIMEOUT = 300.0
ZERO, COPY = "tmx zero-copy", "tmx copy"
QUEUE, GLOO = "torch.mp Queue (snapshot)", "gloo broadcast"


def make_model(mbytes: int) -> torch.nn.Module:
    """Linear(2048, 1024) layers: 8 MiB of weights each, ``mbytes`` MB in all."""
    layers = max(1, round(mbytes * 1e6 / (1024 * 2048 * 4)))
    with torch.no_grad():  # skip the initialisation: the weights are overwritten anyway
        return torch.nn.Sequential(*[torch.nn.utils.skip_init(torch.nn.Linear, 2048, 1024)
                                     for _ in range(layers)]).eval()


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


class Acks:
    """How collectors tell the learner they have a version, the same for every contender.

    While the clock runs, a collector only stamps the time into its slot of a shared array
    and counts itself in; the last one in wakes the learner (one wake-up per round, not
    one per collector: no pickling, no queue, and next to no CPU taken from the contenders,
    which matters on few cores, where every collector's CPU delays the others). Its check
    of the weights runs after the learner stopped the clock, then it reports the result.
    """

    def __init__(self, ctx, collectors: int) -> None:
        self.n = collectors
        self.stamps = ctx.Array("d", collectors, lock=False)
        self.count = ctx.Value("i", 0)
        self.done, self.go = ctx.Semaphore(0), ctx.Semaphore(0)
        self.oks = ctx.Queue()

    def arrived(self, i: int) -> None:
        """Collector ``i``: the version is in its model."""
        self.stamps[i] = time.monotonic()
        with self.count.get_lock():
            self.count.value += 1
            last = self.count.value == self.n
        if last:
            self.done.release()

    def report(self, check, *args) -> None:
        """Collector: runs ``check(*args)`` once the clock stopped and sends its result."""
        if not self.go.acquire(timeout=TIMEOUT):
            raise TimeoutError("the learner never collected the round")
        self.oks.put(check(*args))

    def collect(self) -> tuple[float, bool]:
        """Learner: ``(when the last collector had the version, every check passed)``."""
        if not self.done.acquire(timeout=TIMEOUT):
            raise TimeoutError(f"the collectors did not all load the version in {TIMEOUT} s")
        last = max(self.stamps)
        self.count.value = 0  # every collector waits on go: nobody counts now
        for _ in range(self.n):
            self.go.release()
        return last, all(self.oks.get(timeout=TIMEOUT) for _ in range(self.n))


def serve(publish, acks: Acks, close) -> None:
    """The learner's command loop on stdin: ``round v`` -> JSON line with the timing."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "round":
            v = int(arg[0])
            time.sleep(0.02)  # the collectors finish checking the last round and wait again
            t0, t_published = publish(v)
            last, ok = acks.collect()
            print(json.dumps({"s": last - t0, "publish_s": t_published - t0, "ok": ok}),
                  flush=True)
        elif cmd == "memcpy":
            print(json.dumps(memcpy_cost(int(arg[0]), int(arg[1]))), flush=True)
        else:
            break
    close()


def tmx_collector(ch, acks: Acks, i: int, mbytes: int, zero_copy: bool) -> None:
    model = make_model(mbytes)
    load = ch.borrow_into if zero_copy else ch.read_into
    v = -1
    while True:
        try:
            v = load(model, newer_than=v, timeout=TIMEOUT)
        except EOFError:  # ChannelClosedError
            return
        acks.arrived(i)
        acks.report(holds, model, v)


def tmx_side(mbytes: int, collectors: int, zero_copy: bool) -> None:
    import torch_mp_ext as mp

    ctx = mp.get_context("spawn")
    model = make_model(mbytes)
    ch = mp.StateDictChannel(model)
    acks = Acks(ctx, collectors)
    procs = [ctx.Process(target=tmx_collector, args=(ch, acks, i, mbytes, zero_copy))
             for i in range(collectors)]
    for p in procs:
        p.start()

    def publish(v):
        fill_(model, v)
        t0 = time.monotonic()
        ch.publish(model, v)
        return t0, time.monotonic()

    def close():
        ch.close()
        for p in procs:
            p.join(60)

    serve(publish, acks, close)


def memcpy_cost(mbytes: int, reps: int) -> dict:
    dst, src = make_model(mbytes), make_model(mbytes)
    fill_(dst, 0)
    fill_(src, 1)  # every page faulted in before the clock runs
    pairs = [(d.data_ptr(), s.data_ptr(), d.numel() * d.element_size())
             for d, s in zip(dst.state_dict().values(), src.state_dict().values())]
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for d, s, n in pairs:
            ctypes.memmove(d, s, n)
        times.append(time.perf_counter() - start)
    return {"memcpy": statistics.median(times)}


def torch_collector(q, acks: Acks, i: int, mbytes: int) -> None:
    model = make_model(mbytes)
    while True:
        item = q.get(timeout=TIMEOUT)
        if item is None:
            return
        v, state = item
        model.load_state_dict(state)
        acks.arrived(i)
        del state, item
        acks.report(holds, model, v)


def torch_side(mbytes: int, collectors: int) -> None:
    if "torch_mp_ext" in sys.modules:
        raise RuntimeError("the torch.multiprocessing side must not import torch_mp_ext")
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    model = make_model(mbytes)
    queues = [ctx.Queue() for _ in range(collectors)]
    acks = Acks(ctx, collectors)
    procs = [ctx.Process(target=torch_collector, args=(q, acks, i, mbytes))
             for i, q in enumerate(queues)]
    for p in procs:
        p.start()

    def publish(v):
        fill_(model, v)
        t0 = time.monotonic()
        state = {k: t.clone() for k, t in model.state_dict().items()}
        for q in queues:
            q.put((v, state))
        return t0, time.monotonic()

    def close():
        for q in queues:
            q.put(None)
        for p in procs:
            p.join(60)

    serve(publish, acks, close)


def gloo_collector(rank: int, env: dict, acks: Acks, mbytes: int) -> None:
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
        acks.arrived(rank - 1)
        acks.report(holds, model, v)
    dist.destroy_process_group()


def gloo_side(mbytes: int, collectors: int) -> None:
    import socket

    import torch.distributed as dist
    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(collectors + 1)}
    ctx = tmp.get_context("spawn")
    acks = Acks(ctx, collectors)
    procs = [ctx.Process(target=gloo_collector, args=(r, env, acks, mbytes))
             for r in range(1, collectors + 1)]
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
        return t0, time.monotonic()

    def close():
        dist.broadcast(torch.tensor([-1]), src=0)
        for p in procs:
            p.join(60)
        dist.destroy_process_group()

    serve(publish, acks, close)


# ---- the driver -------------------------------------------------------------------------------

SIDES = {ZERO: ["tmx-zero-copy"], COPY: ["tmx"], QUEUE: ["torch"], GLOO: ["gloo"]}
SHORT = {"zero-copy": ZERO, "copy": COPY, "queue": QUEUE, "gloo": GLOO}  # for --only


def footprint(name: str, nbytes: int, collectors: int) -> tuple[int, int]:
    """(private bytes, /dev/shm bytes) a contender's processes hold at their peak, estimated:
    the learner's model, each collector's model, and what travels (3 channel buffers; a
    snapshot in shared memory, two in flight; gloo's copies)."""
    interpreter = 300 << 20  # one Python with torch imported
    procs = (collectors + 1) * interpreter
    if name == ZERO:  # collectors' own weights: never written (skip_init), freed at the
        return procs + nbytes, 3 * nbytes  # first borrow
    if name == COPY:
        return procs + (collectors + 1) * nbytes, 3 * nbytes
    if name == QUEUE:
        return procs + (collectors + 1) * nbytes, 2 * nbytes
    return procs + 2 * (collectors + 1) * nbytes, 0


def available() -> tuple[int, int]:
    """(MemAvailable, free bytes in /dev/shm)."""
    mem = 0
    with open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                mem = int(line.split()[1]) * 1024
    st = os.statvfs("/dev/shm")
    return mem, st.f_bavail * st.f_frsize


def fits(names: list[str], nbytes: int, collectors: int) -> bool:
    mem, shm = available()
    need = [footprint(n, nbytes, collectors) for n in names]
    private, shared = sum(p for p, _ in need), sum(s for _, s in need)
    return private + shared <= 0.8 * mem and shared <= 0.8 * shm


def start(args: list[str], mbytes: int, collectors: int) -> subprocess.Popen:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    if args[0].startswith("tmx"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--side", args[0],
                             "--mbytes", str(mbytes), "--collectors", str(collectors)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def ask(p: subprocess.Popen, line: str) -> dict:
    p.stdin.write(line + "\n")
    p.stdin.flush()
    out = p.stdout.readline()
    if not out:
        raise RuntimeError(f"a benchmark side died (exit code {p.wait()})")
    return json.loads(out)


def stop(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        try:
            p.stdin.write("quit\n")
            p.stdin.close()
        except OSError:
            pass
        p.wait(120)


def run_group(names: list[str], mbytes: int, collectors: int, repeats: int,
              samples: dict, publish: list, wrong: list) -> None:
    """Runs ``names`` side by side, rounds interleaved; appends to ``samples[name]``."""
    procs = {name: start(SIDES[name], mbytes, collectors) for name in names}
    try:
        for name, p in procs.items():
            if not json.loads(p.stdout.readline()).get("ready"):
                raise RuntimeError(f"{name} did not start")
        for r in range(repeats + 1):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                res = ask(procs[name], f"round {r}")
                if not res["ok"]:
                    wrong.append((name, mbytes, collectors, r))
                if r:  # round 0 warms up
                    samples[name].append(res["s"])
                    if name == ZERO:
                        publish.append(res["publish_s"])
    finally:
        stop(procs)


def run_config(mbytes: int, collectors: int, repeats: int, wrong: list, skipped: list,
               only: list[str]) -> dict:
    """Samples (s) of the contenders ``only`` for one size and number of collectors."""
    nbytes = nbytes_of(make_model(mbytes))
    samples: dict[str, list[float]] = {name: [] for name in SIDES}
    publish: list[float] = []
    names = [n for n in only if fits([n], nbytes, collectors)]
    skipped += [(n, mbytes, collectors) for n in only if n not in names]
    groups = [names] if names and fits(names, nbytes, collectors) else [[n] for n in names]
    for group in groups:
        run_group(group, mbytes, collectors, repeats, samples, publish, wrong)
        print(f"  {mbytes} MB, {collectors} collectors: {', '.join(group)} done",
              file=sys.stderr, flush=True)
    return {"nbytes": nbytes, "samples": samples, "publish": publish}


def memcpy_floor(mbytes: int) -> float:
    p = start(SIDES[COPY], mbytes, 1)
    try:
        json.loads(p.stdout.readline())
        return ask(p, f"memcpy {mbytes} 15")["memcpy"]
    finally:
        stop({"memcpy": p})


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _ms(s: float | None) -> str:
    return "skipped" if s is None else f"{s * 1e3:.1f}"


def _verdict(label: str, value: float | None, ok: bool) -> str:
    if value is None:
        return f"{label}: not measured"
    return f"{label}: {value:.2f}x {'PASS' if ok else 'MISS'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--mbytes", default="100,1000", help="state sizes, MB, comma-separated")
    parser.add_argument("--collectors", default="1,3,8,16", help="comma-separated")
    parser.add_argument("--only", default=",".join(SHORT),
                        help=f"contenders, comma-separated, of {','.join(SHORT)}")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--two-hosts", action="store_true",
                        help="the two-host rows instead (root: network namespaces); then "
                             "--mbytes is one size (default 10) and --collectors the "
                             "collectors per host (default 3)")
    parser.add_argument("--versions", type=int, default=20, help="two hosts: versions sent")
    parser.add_argument("--pause", type=float, default=0.5,
                        help="two hosts: seconds between versions")
    bench_json.add_argument(parser)
    argv = sys.argv[1:]
    args = parser.parse_args()
    if args.two_hosts:
        import bench_exchange_hosts

        args.mbytes = int(args.mbytes) if "--mbytes" in argv else 10
        args.collectors = int(args.collectors) if "--collectors" in argv else 3
        rows = bench_exchange_hosts.two_hosts(args)
        if args.json:
            bench_json.write(args.json, "bench_exchange", rows,
                             params={"mbytes": args.mbytes, "versions": args.versions,
                                     "collectors": args.collectors, "pause": args.pause},
                             rows_doc="two hosts: learner bytes, a->b bytes and seconds until "
                                      "every collector loaded a version, per exchange")
        return 0
    if args.side:
        mbytes, n = int(args.mbytes), int(args.collectors)
        kind = args.side
        if kind.startswith("tmx"):
            tmx_side(mbytes, n, zero_copy=kind == "tmx-zero-copy")
        elif kind == "torch":
            torch_side(mbytes, n)
        else:
            gloo_side(mbytes, n)
        return 0

    sizes, counts = _ints(args.mbytes), _ints(args.collectors)
    unknown = [c for c in args.only.split(",") if c not in SHORT]
    if unknown:
        parser.error(f"--only: unknown contenders {unknown}; choose from {list(SHORT)}")
    only = [SHORT[c] for c in args.only.split(",")]
    print(f"Model exchange: a state_dict (Linear(2048, 1024) layers) from a learner to N "
          f"collectors, until all have it in their models: median of {args.repeats}, ms")
    print(f"Python {platform.python_version()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {platform.machine()}")
    wrong: list = []
    skipped: list = []
    results = {(m, n): run_config(m, n, args.repeats, wrong, skipped, only)
               for m in sizes for n in counts}
    floors = {m: memcpy_floor(m) for m in sizes}

    def med(m: int, n: int, name: str) -> float | None:
        ts = results[(m, n)]["samples"][name]
        return statistics.median(ts) if ts else None

    print()
    print(f"| MB | collectors | {' | '.join(SIDES)} | publish (floor) | memcpy (floor) | "
          f"Queue / zero-copy |")
    print("|---|---|" + "---|" * (len(SIDES) + 3))
    for (m, n), res in results.items():
        pub = statistics.median(res["publish"]) if res["publish"] else None
        zero, queue = med(m, n, ZERO), med(m, n, QUEUE)
        ratio = f"{queue / zero:.1f}x" if zero and queue else "-"
        cells = " | ".join(_ms(med(m, n, name)) if name in only else "-" for name in SIDES)
        print(f"| {res['nbytes'] / 1e6:.0f} | {n} | {cells} | {_ms(pub)} | "
              f"{_ms(floors[m])} | {ratio} |")
    print()
    for m in sizes:  # the targets (issue 32), at every size measured
        lo, hi = min(counts), max(counts)
        z_lo, z_hi = med(m, lo, ZERO), med(m, hi, ZERO)
        pubs = results[(m, hi)]["publish"]
        pub = statistics.median(pubs) if pubs else None
        print(f"{m} MB:")
        print("  " + _verdict(f"zero-copy {hi} collectors / {lo}",
                              z_hi / z_lo if z_hi and z_lo else None,
                              bool(z_hi and z_lo and z_hi <= 1.5 * z_lo)))
        print("  " + _verdict(f"zero-copy {hi} collectors / publish",
                              z_hi / pub if z_hi and pub else None,
                              bool(z_hi and pub and z_hi <= 1.5 * pub)))
        if 3 in counts:
            z3, q3 = med(m, 3, ZERO), med(m, 3, QUEUE)
            print("  " + _verdict("Queue snapshot / zero-copy, 3 collectors",
                                  q3 / z3 if z3 and q3 else None,
                                  bool(z3 and q3 and q3 >= 10 * z3)))
    if skipped:
        print(f"skipped (would not fit in memory): {skipped}")
    if args.json:
        rows = []
        for (_m, n), res in results.items():
            for name, ts in res["samples"].items():
                if ts:
                    rows.append({"series": name, "nbytes": res["nbytes"], "collectors": n,
                                 "median_s": statistics.median(ts), "samples_s": ts})
            if res["publish"]:
                rows.append({"series": "publish (one memcpy into the channel)", "floor": True,
                             "nbytes": res["nbytes"], "collectors": n,
                             "median_s": statistics.median(res["publish"])})
        for m in sizes:
            rows.append({"series": "memcpy", "floor": True,
                         "nbytes": results[(m, counts[0])]["nbytes"], "median_s": floors[m]})
        bench_json.write(args.json, "bench_exchange", rows,
                         params={"repeats": args.repeats, "mbytes": sizes, "only": only,
                                 "collectors": counts, "wrong": wrong, "skipped": skipped},
                         rows_doc="seconds per version until every collector has it in its "
                                  "model, per contender, size and number of collectors; "
                                  "floors: the publish memcpy and a plain memcpy")
    if wrong:
        print(f"WRONG WEIGHTS LOADED: {wrong}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
