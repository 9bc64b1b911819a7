"""Hogwild training with a shared optimizer state learns the same on torch_mp_ext as on
torch.multiprocessing (issue 36), and fork children's thread count is the documented one.

The Hogwild program is A3C's shape (Morvan Zhou's pytorch-A3C, ``tools/a3c_ab.py``): a
``share_memory()`` global net, an Adam whose moments and step are shared tensors updated in
place by every worker, a local net per worker whose gradients are handed to the global one
(``gp._grad = lp.grad``), an ``mp.Value('d')`` under ``get_lock()`` and an ``mp.Queue`` of
floats. The workers take turns (a ``Condition`` on a turn counter), so the run is
deterministic and must match, bit for bit, the same updates made one after another in one
process, whatever the library.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.multiprocessing as torch_mp
import torch.nn.functional as F

import torch_mp_ext as mp

WORKERS = 2
ROUNDS = 3
T = 60.0  # seconds any wait may take
N_PARAMS = 4  # _net's weights and biases


@pytest.fixture(scope="module", autouse=True)
def _stdlib_heap():
    """``Value`` allocates from the standard library's heap, whose first arena (an unlinked
    file, two fds) lives as long as the process: made here, before any test's leak check."""
    multiprocessing.Value("d", 0.0)
    yield


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


class SharedAdam(torch.optim.Adam):
    """Adam whose state lives in shared memory before any process starts."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = torch.zeros(()).share_memory_()
                state["exp_avg"] = torch.zeros_like(p).share_memory_()
                state["exp_avg_sq"] = torch.zeros_like(p).share_memory_()


def _update(gnet, lnet, opt, worker: int, rnd: int) -> float:
    """One A3C-style push and pull: local gradients, global Adam step, fresh local copy."""
    gen = torch.Generator().manual_seed(1000 * worker + rnd)
    x = torch.randn(5, 4, generator=gen)
    y = torch.randint(0, 2, (5,), generator=gen)
    lnet.load_state_dict(gnet.state_dict())
    loss = F.cross_entropy(lnet(x), y)
    opt.zero_grad()
    loss.backward()
    for lp, gp in zip(lnet.parameters(), gnet.parameters()):
        gp._grad = lp.grad
    opt.step()
    return loss.item()


def _hogwild_worker(gnet, opt, turn, cond, total, results, worker: int) -> None:
    lnet = _net()
    for rnd in range(ROUNDS):
        with cond:
            mine = rnd * WORKERS + worker
            if not cond.wait_for(lambda mine=mine: turn.value == mine, timeout=T):
                raise TimeoutError(f"worker {worker} waited {T} s for its turn {rnd}")
            loss = _update(gnet, lnet, opt, worker, rnd)
            with total.get_lock():
                total.value += loss
            results.put((worker, rnd, loss))
            turn.value += 1
            cond.notify_all()


def _state(gnet, opt, losses, total: float) -> list:
    out = [p.detach().clone() for p in gnet.parameters()]
    for p in gnet.parameters():
        out += [opt.state[p][k].clone() for k in ("step", "exp_avg", "exp_avg_sq")]
    # Sorted: torch.multiprocessing's queue does not keep the order of puts made by different
    # processes (each has its own feeder thread), even when the puts took turns.
    return out + [torch.tensor(sorted(losses), dtype=torch.float64), torch.tensor(total)]


def _serial() -> list:
    gnet = _net()
    opt = SharedAdam(gnet.parameters(), lr=0.05)
    lnets = [_net() for _ in range(WORKERS)]
    losses, total = [], 0.0
    for rnd in range(ROUNDS):
        for worker in range(WORKERS):
            loss = _update(gnet, lnets[worker], opt, worker, rnd)
            total += loss
            losses.append((worker, rnd, loss))
    return _state(gnet, opt, losses, total)


def _hogwild(lib) -> list:
    ctx = lib.get_context("fork")
    gnet = _net()
    gnet.share_memory()
    opt = SharedAdam(gnet.parameters(), lr=0.05)
    turn, total, cond = ctx.Value("i", 0), ctx.Value("d", 0.0), ctx.Condition()
    results = ctx.Queue()
    procs = [ctx.Process(target=_hogwild_worker,
                         args=(gnet, opt, turn, cond, total, results, w))
             for w in range(WORKERS)]
    for p in procs:
        p.start()
    try:
        losses = [results.get(timeout=T) for _ in range(WORKERS * ROUNDS)]
    finally:
        for p in procs:
            p.join(T)
    assert [p.exitcode for p in procs] == [0] * WORKERS
    results.close()
    return _state(gnet, opt, losses, total.value)


@pytest.fixture
def one_thread():
    """The parent runs torch with one thread, so torch.multiprocessing's fork children do too:
    with more, after the parent's own parallel ops (even ``_net()(x)`` runs one), their first
    parallel op would hang in libgomp (Note [OpenMP after fork])."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow  # three Hogwild runs (two libraries and one process): the fast tier's budget
def test_hogwild_with_a_shared_adam_matches_torch_and_one_process(one_thread):
    expected = _serial()
    for lib in (torch_mp, mp):
        got = _hogwild(lib)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), lib.__name__
    # The shared state really was shared: every worker's steps counted in one place.
    assert expected[N_PARAMS].item() == WORKERS * ROUNDS


def _report_threads(q) -> None:
    q.put(torch.get_num_threads())


@pytest.mark.parametrize("lib, expected", [(torch_mp, 2), (mp, 1)],
                         ids=["torch.multiprocessing", "torch_mp_ext"])
def test_fork_child_thread_count(lib, expected):
    """Note [OpenMP after fork]: our fork children run torch with one thread; torch's keep
    the parent's count (docs/differences/openmp-after-fork.md)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ctx = lib.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_report_threads, args=(q,))
        p.start()
        try:
            assert q.get(timeout=T) == expected
        finally:
            p.join(T)
        assert p.exitcode == 0
        q.close()
    finally:
        torch.set_num_threads(before)
