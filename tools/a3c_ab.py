"""A/B of a Hogwild A3C program on torch.multiprocessing and torch_mp_ext (issue 36).

The program is Morvan Zhou's discrete A3C (github.com/MorvanZhou/pytorch-A3C:
``discrete_A3C.py``, ``shared_adam.py``, ``utils.py``), rewritten here from its structure:
CartPole through gymnasium (``pip install gymnasium``), ``mp.cpu_count()`` Hogwild workers that
are ``mp.Process`` subclasses, a ``share_memory()`` global net, an Adam whose moments are shared,
an ``mp.Value('i')`` episode counter and an ``mp.Value('d')`` moving average updated under
``get_lock()``, and an ``mp.Queue`` of floats read by the parent. What is not the original's:

- seeds: ``torch.manual_seed``/``np.random.seed`` in the parent before the nets are built (the
  fork children inherit that state, as they inherit the unseeded one in the original) and each
  worker's environment seeded ``seed * 1000 + index`` at its first reset;
- ``state["step"]`` is a 0-d tensor, as torch 2.x's Adam requires (the original's int raises
  "API has changed"); like the original's int it is not shared, so each worker counts its own;
- no rendering, gymnasium's reset/step signatures, a timeout on the parent's ``get``;
- knobs for the mechanism: ``--threads N`` calls ``torch.set_num_threads(N)`` at the top of
  each worker's ``run`` (``1`` gives stock torch_mp_ext's cap, Note [OpenMP after fork]; ``0``
  leaves the thread count as the child found it); ``--step-delay S`` sleeps ``S`` seconds
  after each environment step (to slow one side's workers to the other's step rate);
  ``--old-zero-grad`` calls ``zero_grad(set_to_none=False)``, torch 1.x's default. With
  torch 2.x's ``set_to_none=True`` the program's local gradients are never zeroed (the
  global ``grad`` it drops *is* the local one), so each push hands Adam the sum of all the
  worker's gradients so far; with the old default it hands the latest, as written.

Everything else (network, loss, ``push_and_pull``, ``record``, hyper-parameters, unwrapped
``CartPole-v0``, ``zero_grad`` as torch 2.13 does it) is the program as users run it.

Modes::

    # one run, in this process; prints one JSON line (final moving average, steps/s ...)
    python tools/a3c_ab.py run --mp tmx --seed 3 --max-ep 800 [--threads 1] [--step-delay 0]
        [--old-zero-grad]

    # the A/B: RUNS seeded runs per side, interleaved (torch, tmx, tmx, torch, ...: each pair
    # in alternating order), one at a time, each in a fresh interpreter; then the medians,
    # the collapsed runs per side, a two-sided Mann-Whitney U test on the final rewards and
    # Fisher's exact test on the collapse counts
    python tools/a3c_ab.py ab --runs 12 --max-ep 800 [--a torch] [--b tmx] [--json out.json]

``--a``/``--b`` name a side as ``LIB[:threads=N][:delay=S][:oldzero]``, e.g. ``--a
torch:threads=1 --b tmx:threads=2`` (each library with the other's thread count). The load
average before each run is recorded: the learning curve of a Hogwild program depends on how
its workers interleave, so runs on a loaded machine are a different experiment.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Optional

#: A run whose final moving average is below this has collapsed: the policy picks one action
#: and CartPole falls in ~9 steps (reward about 7 with the program's -1 at the end).
COLLAPSED_BELOW = 10.0

UPDATE_GLOBAL_ITER = 5
GAMMA = 0.9
QUEUE_TIMEOUT_S = 1800.0


# --- the program -------------------------------------------------------------------------

def run_program(lib: str, seed: int, max_ep: int, threads: int, step_delay: float,
                workers: Optional[int], old_zero_grad: bool = False) -> dict[str, Any]:
    """One training run; returns its results. ``lib`` is ``torch`` or ``tmx``."""
    import gymnasium as gym
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    mp: Any = importlib.import_module(
        "torch.multiprocessing" if lib == "torch" else "torch_mp_ext")
    os.environ["OMP_NUM_THREADS"] = "1"  # as the program: after import torch, so no effect

    env = gym.make("CartPole-v0")
    n_s = env.observation_space.shape[0]
    n_a = env.action_space.n

    def v_wrap(np_array: Any, dtype: Any = np.float32) -> Any:
        if np_array.dtype != dtype:
            np_array = np_array.astype(dtype)
        return torch.from_numpy(np_array)

    def set_init(layers: list) -> None:
        for layer in layers:
            nn.init.normal_(layer.weight, mean=0.0, std=0.1)
            nn.init.constant_(layer.bias, 0.0)

    class Net(nn.Module):
        def __init__(self, s_dim: int, a_dim: int) -> None:
            super().__init__()
            self.pi1 = nn.Linear(s_dim, 128)
            self.pi2 = nn.Linear(128, a_dim)
            self.v1 = nn.Linear(s_dim, 128)
            self.v2 = nn.Linear(128, 1)
            set_init([self.pi1, self.pi2, self.v1, self.v2])
            self.distribution = torch.distributions.Categorical

        def forward(self, x: Any) -> Any:
            logits = self.pi2(torch.tanh(self.pi1(x)))
            values = self.v2(torch.tanh(self.v1(x)))
            return logits, values

        def choose_action(self, s: Any) -> Any:
            self.eval()
            logits, _ = self.forward(s)
            prob = F.softmax(logits, dim=1).data
            return self.distribution(prob).sample().numpy()[0]

        def loss_func(self, s: Any, a: Any, v_t: Any) -> Any:
            self.train()
            logits, values = self.forward(s)
            td = v_t - values
            c_loss = td.pow(2)
            m = self.distribution(F.softmax(logits, dim=1))
            a_loss = -m.log_prob(a) * td.detach().squeeze()
            return (c_loss + a_loss).mean()

    class SharedAdam(torch.optim.Adam):
        def __init__(self, params: Any, lr: float, betas: tuple) -> None:
            super().__init__(params, lr=lr, betas=betas, eps=1e-8, weight_decay=0)
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    state["step"] = torch.zeros(())  # the original: 0 (an int)
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                    state["exp_avg"].share_memory_()
                    state["exp_avg_sq"].share_memory_()

    def push_and_pull(opt: Any, lnet: Any, gnet: Any, done: bool, s_: Any, bs: list,
                      ba: list, br: list) -> None:
        v_s_ = 0.0 if done else lnet.forward(v_wrap(s_[None, :]))[-1].data.numpy()[0, 0]
        buffer_v_target = []
        for r in br[::-1]:
            v_s_ = r + GAMMA * v_s_
            buffer_v_target.append(v_s_)
        buffer_v_target.reverse()
        loss = lnet.loss_func(v_wrap(np.vstack(bs)), v_wrap(np.array(ba), dtype=np.int64),
                              v_wrap(np.array(buffer_v_target)[:, None]))
        opt.zero_grad(set_to_none=not old_zero_grad)
        loss.backward()
        for lp, gp in zip(lnet.parameters(), gnet.parameters()):
            gp._grad = lp.grad
        opt.step()
        lnet.load_state_dict(gnet.state_dict())

    def record(global_ep: Any, global_ep_r: Any, ep_r: float, res_queue: Any,
               name: str) -> None:
        with global_ep.get_lock():
            global_ep.value += 1
        with global_ep_r.get_lock():
            if global_ep_r.value == 0.0:
                global_ep_r.value = ep_r
            else:
                global_ep_r.value = global_ep_r.value * 0.99 + ep_r * 0.01
        res_queue.put(global_ep_r.value)
        print(name, "Ep:", global_ep.value, f"| Ep_r: {global_ep_r.value:.0f}")

    class Worker(mp.Process):
        def __init__(self, gnet: Any, opt: Any, global_ep: Any, global_ep_r: Any,
                     res_queue: Any, steps: Any, index: int) -> None:
            super().__init__()
            self.name = f"w{index:02d}"
            self.index = index
            self.g_ep, self.g_ep_r, self.res_queue = global_ep, global_ep_r, res_queue
            self.gnet, self.opt = gnet, opt
            self.steps = steps
            self.lnet = Net(n_s, n_a)
            self.env = gym.make("CartPole-v0").unwrapped

        def run(self) -> None:
            if threads > 0:
                torch.set_num_threads(threads)
            self.steps[self.index, 2] = torch.get_num_threads()
            started = time.monotonic()
            total_step = 1
            first = True
            while self.g_ep.value < max_ep:
                s, _ = self.env.reset(seed=seed * 1000 + self.index if first else None)
                first = False
                buffer_s, buffer_a, buffer_r = [], [], []
                ep_r = 0.0
                while True:
                    a = self.lnet.choose_action(v_wrap(s[None, :]))
                    s_, r, terminated, truncated, _ = self.env.step(a)
                    done = terminated or truncated
                    if step_delay:
                        time.sleep(step_delay)
                    if done:
                        r = -1
                    ep_r += r
                    buffer_a.append(a)
                    buffer_s.append(s)
                    buffer_r.append(r)
                    if total_step % UPDATE_GLOBAL_ITER == 0 or done:
                        push_and_pull(self.opt, self.lnet, self.gnet, done, s_, buffer_s,
                                      buffer_a, buffer_r)
                        buffer_s, buffer_a, buffer_r = [], [], []
                        if done:
                            record(self.g_ep, self.g_ep_r, ep_r, self.res_queue, self.name)
                            break
                    s = s_
                    total_step += 1
            self.steps[self.index, 0] = total_step
            self.steps[self.index, 1] = time.monotonic() - started
            self.res_queue.put(None)

    torch.manual_seed(seed)
    np.random.seed(seed)
    gnet = Net(n_s, n_a)
    gnet.share_memory()
    opt = SharedAdam(gnet.parameters(), lr=1e-4, betas=(0.92, 0.999))
    global_ep, global_ep_r, res_queue = mp.Value("i", 0), mp.Value("d", 0.0), mp.Queue()
    count = mp.cpu_count() if workers is None else workers
    steps = torch.zeros(count, 3, dtype=torch.float64).share_memory_()

    started = time.monotonic()
    ws = [Worker(gnet, opt, global_ep, global_ep_r, res_queue, steps, i) for i in range(count)]
    [w.start() for w in ws]
    res = []
    while True:
        r = res_queue.get(timeout=QUEUE_TIMEOUT_S)
        if r is None:
            break
        res.append(r)
    [w.join() for w in ws]
    wall = time.monotonic() - started
    final = float(global_ep_r.value)
    return {
        "lib": lib, "seed": seed, "max_ep": max_ep, "threads": threads,
        "step_delay": step_delay, "old_zero_grad": old_zero_grad, "workers": count,
        "final": final,
        "last_read": res[-1] if res else None, "episodes": int(global_ep.value),
        "collapsed": final < COLLAPSED_BELOW, "wall_s": wall,
        "steps_per_s": [float(n / t) if t else None for n, t, _ in steps.tolist()],
        "child_threads": [int(k) for _, _, k in steps.tolist()],
        "exitcodes": [w.exitcode for w in ws],
    }


# --- statistics --------------------------------------------------------------------------

def mann_whitney_u(a: list[float], b: list[float]) -> tuple[float, float]:
    """(U of ``a``, two-sided p) of the Mann-Whitney U test. scipy's when installed; else the
    exact distribution without ties, the normal approximation with tie correction with them."""
    try:
        from scipy.stats import mannwhitneyu
    except ImportError:
        pass
    else:
        out = mannwhitneyu(a, b, alternative="two-sided")
        return float(out.statistic), float(out.pvalue)
    n, m = len(a), len(b)
    values = sorted(a + b)
    ranks: dict[float, float] = {}
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        ranks[values[i]] = (i + j) / 2 + 1
        i = j + 1
    u = sum(ranks[x] for x in a) - n * (n + 1) / 2
    if len(ranks) == len(values):  # no ties: exact, counting rank sets by U
        ways = _u_counts(n, m)
        total = math.comb(n + m, n)
        low = sum(ways[: int(min(u, n * m - u)) + 1]) / total
        return u, min(1.0, 2 * low)
    ties = sum(t**3 - t for t in _tie_sizes(values))
    sigma = math.sqrt(n * m / 12 * ((n + m + 1) - ties / ((n + m) * (n + m - 1))))
    z = (abs(u - n * m / 2) - 0.5) / sigma if sigma else 0.0
    return u, min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2)))


def _tie_sizes(values: list[float]) -> list[int]:
    sizes, run = [], 1
    for x, y in zip(values, values[1:]):
        if x == y:
            run += 1
        else:
            sizes.append(run)
            run = 1
    return sizes + [run]


def _u_counts(n: int, m: int) -> list[int]:
    """Number of arrangements of n a's and m b's for each U = 0..n*m (a's above b's)."""
    table: dict[tuple[int, int], list[int]] = {}

    def counts(i: int, j: int) -> list[int]:
        if i == 0 or j == 0:
            return [1]
        if (i, j) not in table:
            last_a = counts(i - 1, j)  # the largest value is an a: it beats j b's
            last_b = counts(i, j - 1)
            out = [0] * (i * j + 1)
            for k, c in enumerate(last_a):
                out[k + j] += c
            for k, c in enumerate(last_b):
                out[k] += c
            table[(i, j)] = out
        return table[(i, j)]

    return counts(n, m)


def fisher_exact(a_hits: int, a_n: int, b_hits: int, b_n: int) -> float:
    """Two-sided p of Fisher's exact test on (a_hits of a_n) against (b_hits of b_n)."""
    hits, total = a_hits + b_hits, a_n + b_n

    def prob(k: int) -> float:
        return math.comb(a_n, k) * math.comb(b_n, hits - k) / math.comb(total, hits)

    observed = prob(a_hits)
    ks = range(max(0, hits - b_n), min(hits, a_n) + 1)
    return min(1.0, sum(p for p in map(prob, ks) if p <= observed * (1 + 1e-9)))


# --- the A/B driver ----------------------------------------------------------------------

def parse_side(text: str) -> dict[str, Any]:
    """``LIB[:threads=N][:delay=S][:oldzero]`` -> the run's options."""
    lib, *opts = text.split(":")
    if lib not in ("torch", "tmx"):
        raise ValueError(f"a side's library is 'torch' or 'tmx', got {lib!r}")
    side: dict[str, Any] = {"lib": lib, "threads": 0, "step_delay": 0.0, "oldzero": False}
    for opt in opts:
        key, _, value = opt.partition("=")
        if key == "threads":
            side["threads"] = int(value)
        elif key == "delay":
            side["step_delay"] = float(value)
        elif key == "oldzero" and not value:
            side["oldzero"] = True
        else:
            raise ValueError(f"unknown option {opt!r} in side {text!r}: threads=N, delay=S "
                             "or oldzero")
    return side


def one_run(side: dict[str, Any], seed: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "run", "--mp", side["lib"],
           "--seed", str(seed), "--max-ep", str(args.max_ep), "--threads",
           str(side["threads"]), "--step-delay", str(side["step_delay"])]
    if args.workers is not None:
        cmd += ["--workers", str(args.workers)]
    if side["oldzero"]:
        cmd.append("--old-zero-grad")
    load = os.getloadavg()[0]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
    if done.returncode != 0:
        raise RuntimeError(f"run {cmd} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["load_before"] = load
    return out


def ab(args: argparse.Namespace) -> None:
    sides = {"A": parse_side(args.a), "B": parse_side(args.b)}
    results: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    for i in range(args.runs):
        seed = args.first_seed + i
        for key in ("A", "B") if i % 2 == 0 else ("B", "A"):
            out = one_run(sides[key], seed, args)
            results[key].append(out)
            print(f"seed {seed:3d} {key} {args.a if key == 'A' else args.b:>24}: final "
                  f"{out['final']:7.1f}  steps/s/worker {_mean(out['steps_per_s']):7.0f}  "
                  f"wall {out['wall_s']:5.1f} s  load {out['load_before']:.2f}", flush=True)
    a = [r["final"] for r in results["A"]]
    b = [r["final"] for r in results["B"]]
    u, p = mann_whitney_u(a, b)
    ca = sum(r["collapsed"] for r in results["A"])
    cb = sum(r["collapsed"] for r in results["B"])
    print()
    for key, name, finals, coll in (("A", args.a, a, ca), ("B", args.b, b, cb)):
        rates = [_mean(r["steps_per_s"]) for r in results[key]]
        print(f"{key} {name:>24}: median final {_median(finals):7.1f}  mean {_mean(finals):7.1f}"
              f"  collapsed {coll}/{len(finals)}  median steps/s/worker {_median(rates):7.0f}")
    print(f"Mann-Whitney U (two-sided) on final rewards: U = {u:.1f}, p = {p:.3f}")
    fisher = fisher_exact(ca, len(a), cb, len(b))
    print(f"Fisher's exact test on collapse counts: p = {fisher:.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"a": args.a, "b": args.b, "max_ep": args.max_ep, "results": results,
                       "mann_whitney": {"u": u, "p": p}, "uname": os.uname().release,
                       "cpus": os.cpu_count()}, f, indent=1)


def _mean(xs: list) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    k = len(s) // 2
    return s[k] if len(s) % 2 else (s[k - 1] + s[k]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("run", help="one run in this process; prints one JSON line")
    run.add_argument("--mp", choices=["torch", "tmx"], required=True)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--max-ep", type=int, default=800)
    run.add_argument("--threads", type=int, default=0,
                     help="torch.set_num_threads(N) in each worker (0: leave as found)")
    run.add_argument("--step-delay", type=float, default=0.0)
    run.add_argument("--workers", type=int, default=None, help="default: mp.cpu_count()")
    run.add_argument("--old-zero-grad", action="store_true",
                     help="zero_grad(set_to_none=False), torch 1.x's default")
    both = sub.add_parser("ab", help="the interleaved A/B")
    both.add_argument("--runs", type=int, default=12, help="runs per side")
    both.add_argument("--max-ep", type=int, default=800)
    both.add_argument("--first-seed", type=int, default=0)
    both.add_argument("--a", default="torch", help="LIB[:threads=N][:delay=S][:oldzero]")
    both.add_argument("--b", default="tmx", help="LIB[:threads=N][:delay=S][:oldzero]")
    both.add_argument("--workers", type=int, default=None)
    both.add_argument("--run-timeout", type=float, default=1800.0)
    both.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    if args.mode == "run":
        out = run_program(args.mp, args.seed, args.max_ep, args.threads, args.step_delay,
                          args.workers, args.old_zero_grad)
        sys.stdout.flush()
        print(json.dumps(out))
    else:
        ab(args)


if __name__ == "__main__":
    main()
