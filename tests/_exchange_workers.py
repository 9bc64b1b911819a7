"""Module-level child targets for the channel and exchanger tests (spawn imports them)."""

from __future__ import annotations

import os
import time

import torch

import torch_mp_ext as mp
from torch_mp_ext.exchange import (
    Context,
    ContextExchanger,
    ModelExchanger,
    PeriodicalModelExchanger,
    run_step,
)
from torch_mp_ext.sharing import memory

STEPS = 12  # collector steps in the toy loop


class Net(torch.nn.Module):
    """A small model with an integer buffer (BatchNorm's num_batches_tracked)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 256)
        self.bn = torch.nn.BatchNorm1d(256)
        self.fc2 = torch.nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def big_state(nbytes: int, ntensors: int = 48) -> dict[str, torch.Tensor]:
    """``ntensors`` float32 tensors of ``nbytes`` in all."""
    n = nbytes // 4 // ntensors
    return {f"t{i:02d}": torch.zeros(n) for i in range(ntensors)}


def fill_(state: dict | torch.nn.Module, value: float) -> None:
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    with torch.no_grad():
        for t in state.values():
            t.fill_(value)


def uniform_value(state: dict | torch.nn.Module) -> float | None:
    """The one value every element of every tensor holds, or None for a mix."""
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    values = set()
    for t in state.values():
        values.update(torch.unique(t.double()).tolist())
    return values.pop() if len(values) == 1 else None


# ---- the channel -------------------------------------------------------------------------


def read_once(ch, out, newer_than, timeout, reading=None):
    """Reads one version (timed), reports (version, uniform value, seconds waited) or the
    exception's class name. Sets the event ``reading``, if given, once the clock runs."""
    start = time.monotonic()
    if reading is not None:
        reading.set()
    try:
        version, state = ch.read(newer_than, timeout=timeout)
    except Exception as exc:  # noqa: BLE001  (reported to the test)
        out.put((type(exc).__name__, time.monotonic() - start))
        return
    out.put((version, uniform_value(state), time.monotonic() - start))


def publish_versions(ch, template, versions, out):
    """Publishes each version with every tensor filled with it."""
    state = {k: torch.zeros_like(v) for k, v in template.items()}
    for v in versions:
        fill_(state, v)
        ch.publish(state, v)
    out.put(("published", list(versions)))


def try_publish(ch, template, version, out):
    """Publishes once; reports None or the exception's type name and message."""
    state = {k: torch.zeros_like(v) for k, v in template.items()}
    try:
        ch.publish(state, version, timeout=5)
    except Exception as exc:  # noqa: BLE001  (reported to the test)
        out.put((type(exc).__name__, str(exc)))
    else:
        out.put(None)


def publish_forever(ch, nbytes, first):
    """Publishes first, first + 1, ... until killed (each version its own value)."""
    state = big_state(nbytes)
    v = first
    while True:
        fill_(state, v)
        ch.publish(state, v)
        v += 1


def read_forever(ch, nbytes):
    """Reads the newest version over and over until killed."""
    dest = big_state(nbytes)
    while True:
        ch.read_into(dest, timeout=60)


def read_and_check(ch, template, out, until_version, deadline_s):
    """Reads newer versions until ``until_version``; reports every (version, value)."""
    dest = {k: torch.zeros_like(v) for k, v in template.items()}
    seen, v = [], -1
    deadline = time.monotonic() + deadline_s
    while v < until_version and time.monotonic() < deadline:
        v = ch.read_into(dest, v, timeout=max(0.0, deadline - time.monotonic()))
        seen.append((v, uniform_value(dest)))
    out.put(seen)


# ---- exchangers on one host ----------------------------------------------------------------


def learner(model_ch, ctx_ch, out, expected):
    """Trains on random data until it merged ``expected`` trajectories; each published
    version has every tensor equal to the version number."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    models = ModelExchanger(model, role="learner", channel=model_ch)
    contexts = ContextExchanger(role="learner", channel=ctx_ch, timeout=30)
    ctx, merged, published = Context(), [], []

    def train(ctx):
        merged.extend(ctx.trajectories or ())
        loss = model(torch.randn(16, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        fill_(model, models.version + 1)  # the version send() publishes after the step
        published.append(models.version + 1)
        ctx.train_iter += 1

    while len(merged) < expected:
        ctx.trajectories = None
        run_step(ctx, contexts, train, models)
    models.close()
    contexts.close()
    out.put(("learner", published, sorted(merged), ctx.env_step, ctx.env_episode, ctx.train_iter))


def collector(index, model_ch, ctx_ch, out):
    """Collects with the newest model: loads one before every step but the first."""
    torch.manual_seed(index + 1)
    model = Net()
    fill_(model, -1.0)
    models = ModelExchanger(model, role="collector", channel=model_ch, timeout=30)
    contexts = ContextExchanger(role="collector", channel=ctx_ch, timeout=30)
    loads, train_iters = [], []
    for step in range(STEPS):
        ctx = Context(total_step=step, env_step=step * 10, env_episode=step)
        seen = models.version

        def collect(ctx, step=step):
            with torch.no_grad():
                model.eval()
                model(torch.randn(4, 64))
            train_iters.append(ctx.train_iter)
            ctx.trajectories = [(index, step, i) for i in range(3)]
            ctx.env_step += 10
            ctx.env_episode += 1

        run_step(ctx, models, contexts, collect)
        if models.version != seen:
            loads.append((models.version, uniform_value(model)))
    out.put(("collector", index, loads, train_iters))


def periodic_sender(model_ch, out, iterations, period, pause):
    """PeriodicalModelExchanger's sender: every iteration fills the model with its index."""
    model = Net()
    models = PeriodicalModelExchanger(model, "send", period=period, channel=model_ch)
    sent = []
    for i in range(iterations):
        fill_(model, i)
        ctx = Context(total_step=i)
        run_step(ctx, models)
        if i % period == 0:
            sent.append(i)
        time.sleep(pause)
    models.close()
    out.put(("sender", sent))


def periodic_receiver(index, model_ch, out, period, stale_toleration, pause):
    """PeriodicalModelExchanger's receiver: records what each step did until the end."""
    model = Net()
    fill_(model, -1.0)
    models = PeriodicalModelExchanger(model, "receive", period=period,
                                      stale_toleration=stale_toleration, channel=model_ch,
                                      timeout=30)
    steps = []
    step = 0
    while not models.finished:
        before = models.model_id
        run_step(Context(total_step=step), models)
        loaded = models.model_id if models.model_id != before else None
        steps.append((loaded, models.model_stale, uniform_value(model)))
        step += 1
        time.sleep(pause)
    out.put(("receiver", index, steps))


def gloo_worker(rank, out):
    """The toy loop over torch.distributed (gloo): rank 0 learns, the others collect."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(rank)
    model = Net()
    role = "learner" if rank == 0 else "collector"
    models = ModelExchanger(model, role=role, backend="distributed", timeout=30)  # gloo: CPU
    contexts = ContextExchanger(role=role, backend="gloo", timeout=30)
    if rank == 0:
        ctx, merged, published = Context(), [], []
        while len(merged) < 2 * STEPS * 3:
            ctx.trajectories = None
            contexts.receive(ctx)
            merged.extend(ctx.trajectories or ())
            fill_(model, models.version + 1)
            published.append(models.send())
            ctx.train_iter += 1
            contexts.send(ctx)
        models.close()
        contexts.close()
        out.put(("learner", published, sorted(merged), ctx.env_step))
    else:
        fill_(model, -1.0)
        loads = []
        for step in range(STEPS):
            ctx = Context(total_step=step, env_step=step * 10)
            if step:
                v = models.receive()
                loads.append((v, uniform_value(model)))
            contexts.receive(ctx)
            ctx.trajectories = [(rank, step, i) for i in range(3)]
            ctx.env_step += 10
            contexts.send(ctx)
        models.close()
        contexts.close()
        out.put(("collector", rank, loads))
    dist.destroy_process_group()


# ---- crash scenarios (run in a fresh interpreter: a SIGKILLed process's references to the
# ---- channel stay counted until its owner exits, see docs/sharing.md) ------------------------


def _wait_for(predicate, timeout=30.0, interval=0.0005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def _copy_time(ch, state, version):
    start = time.monotonic()
    ch.publish(state, version)
    return time.monotonic() - start


def scenario_writer_killed(nbytes: int = 192 << 20, attempts: int = 5) -> dict:
    """SIGKILLs a writer in the middle of its copy; reports what readers see after."""
    import signal

    from torch_mp_ext import _C

    ctx = mp.get_context("fork")
    state = big_state(nbytes)
    ch = mp.StateDictChannel(state, buffers=2)
    fill_(state, 0)
    copy_s = _copy_time(ch, state, 0)
    report = {"copy_s": copy_s}
    for attempt in range(1, attempts + 1):
        first = ch.version + 1
        p = ctx.Process(target=publish_forever, args=(ch, nbytes, first))
        p.start()

        def writing(p=p):
            st = ch._debug_state()
            return st["writer_pid"] == p.pid and any(s & _C.LATEST_WRITING for s in st["stamps"])

        _wait_for(writing)
        time.sleep(copy_s / 2)  # into the middle of the copy
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        st = ch._debug_state()
        index = next((i for i, s in enumerate(st["stamps"]) if s & _C.LATEST_WRITING), None)
        if index is None:
            continue  # killed between two publishes: try again
        latest = ch.version
        being = (st["stamps"][index] & ~_C.LATEST_WRITING) - 1  # what the buffer held before
        values = [uniform_value({"t": ch._view(index, e)}) for e in ch._entries]
        written = sum(1 for v in values if v == latest + 1)
        report.update(attempt=attempt, writer_pid_left=st["writer_pid"] == p.pid,
                      latest=latest, written=written, ntensors=len(values), previous=being)
        if 0 < written < len(values):
            break
    version, got = ch.read(timeout=10)
    report.update(read_version=version, read_value=uniform_value(got))
    fill_(state, ch.version + 1)
    report["takeover_version"] = ch.publish(state, timeout=10)
    version, got = ch.read(timeout=10)
    report.update(after_version=version, after_value=uniform_value(got))
    return report


def scenario_reader_killed(nbytes: int = 192 << 20) -> dict:
    """SIGKILLs a reader in the middle of its copy; the writer and other readers go on."""
    import signal

    ctx = mp.get_context("fork")
    state = big_state(nbytes)
    ch = mp.StateDictChannel(state, buffers=2)
    fill_(state, 0)
    copy_s = _copy_time(ch, state, 0)
    p = ctx.Process(target=read_forever, args=(ch, nbytes))
    p.start()

    def pinned():
        return any(pid == p.pid and pin for pid, pin in ch._debug_state()["readers"])

    _wait_for(pinned)
    time.sleep(copy_s / 2)
    still = pinned()
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    report = {"killed_while_pinned": still and pinned()}
    times = []
    for v in (1, 2, 3):  # with 2 buffers, v2 needs the buffer the dead reader pinned
        fill_(state, v)
        start = time.monotonic()
        ch.publish(state, v, timeout=10)
        times.append(time.monotonic() - start)
    report["publish_s"] = times
    report["dead_reader_left"] = any(pid == p.pid for pid, _ in ch._debug_state()["readers"])
    out = ctx.Queue()
    peer = ctx.Process(target=read_once, args=(ch, out, -1, 10))
    peer.start()
    report["peer"] = out.get(timeout=30)[:2]
    peer.join(30)
    return report


def run_scenario(name: str) -> None:
    """Entry point of ``python -c``: prints the scenario's report as JSON."""
    import json

    print(json.dumps(globals()[f"scenario_{name}"]()), flush=True)


def gloo_periodical_worker(rank, out):
    """PeriodicalModelExchanger over gloo: rank 0 sends every 2nd iteration."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = Net()
    mode = "send" if rank == 0 else "receive"
    models = PeriodicalModelExchanger(model, mode, period=2, stale_toleration=2,
                                      backend="gloo", timeout=30)
    if rank == 0:
        for i in range(20):
            fill_(model, i)
            models.send()
            time.sleep(0.02)
        models.close()
        out.put(("sender", rank, None))
    else:
        fill_(model, -1.0)
        steps, step = [], 0
        while not models.finished:
            before = models.model_id
            run_step(Context(total_step=step), models)
            loaded = models.model_id if models.model_id != before else None
            steps.append((loaded, models.model_stale, uniform_value(model)))
            step += 1
            time.sleep(0.015)
        models.close()
        out.put(("receiver", rank, steps))
    dist.destroy_process_group()


# ---- a learner that dies (issue 26: its death must not read as its finish) -----------------


def dying_learner(model_ch, ctx_ch, go, backend="shm"):
    """Publishes a model and a context, waits for a collector's word, then SIGKILLs itself."""
    import signal

    if backend != "shm":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    model = Net()
    models = ModelExchanger(model, role="learner", channel=model_ch, backend=backend)
    contexts = ContextExchanger(role="learner", channel=ctx_ch, backend=backend)
    fill_(model, 0)
    models.send()
    contexts.send(Context(train_iter=1))
    go.get(timeout=60)  # the collector loaded both and is back in its loops
    os.kill(os.getpid(), signal.SIGKILL)


def collector_until_finished(model_ch, ctx_ch, go, out, backend="shm"):
    """The seed's loops, ``while not finished: receive()``; reports how each one ended."""
    if backend != "shm":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    model = Net()
    models = ModelExchanger(model, role="collector", channel=model_ch, backend=backend,
                            timeout=30)
    contexts = ContextExchanger(role="collector", channel=ctx_ch, backend=backend, timeout=30)
    ctx = Context(total_step=5)
    while contexts.receive(ctx) is False or ctx.train_iter != 1:
        pass
    models.receive()
    go.put(True)
    ends = []
    for loop in (lambda: models.receive(), lambda: contexts.receive(ctx)):
        exchanger = models if not ends else contexts
        try:
            while not exchanger.finished:
                loop()
            ends.append(("finished", None))
        except Exception as exc:  # noqa: BLE001  (reported to the test)
            ends.append((type(exc).__name__, str(exc)))
    out.put((models.version, ends))
    if backend != "shm":
        os._exit(0)  # the group's store lived in the learner: no orderly teardown is possible


# ---- the hierarchical exchange (HostRelay) on one host: rank 0 learns, rank 1 relays -----------


def relay_learner(versions, kill_after, go, out):
    """Rank 0: publishes ``versions`` versions of a 4 MB state (each filled with its number)
    and its ``train_iter``, waits for contexts from both collectors, then closes; SIGKILLs
    itself after publishing ``kill_after`` instead, if it is >= 0."""
    import signal

    import torch.distributed as dist

    dist.init_process_group("gloo")
    state = big_state(4 << 20)
    models = ModelExchanger(_Stateful(state), role="learner", backend="gloo")
    contexts = ContextExchanger(role="learner", backend="gloo")
    go.get(timeout=60)  # the relay's collectors are running
    for v in range(versions):
        fill_(state, v)
        models.send()
        if v == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        contexts.send(Context(train_iter=v))
        time.sleep(0.02)
    senders, deadline = set(), time.monotonic() + 60
    while senders != {0, 1} and time.monotonic() < deadline:
        ctx = Context()
        contexts.receive(ctx, timeout=5)
        senders.update(ctx.trajectories or ())
    models.close()
    contexts.close()
    out.put(("learner", sorted(senders)))
    dist.destroy_process_group()


def relay_collector(channel, context_channel, out, index):
    """A process on the relay's host: reads until finished, sending its index up as its
    trajectories; reports the reads, the learner's newest train_iter and how it ended.
    Collector 1 reads in place (copy=False): one copy per host, then none."""
    state = big_state(4 << 20)
    models = ModelExchanger(_Stateful(state), role="collector", channel=channel, timeout=30,
                            copy=index != 1)
    contexts = ContextExchanger(role="collector", channel=context_channel, timeout=30)
    reads, end, ctx = [], "finished", Context(train_iter=-1)
    try:
        while not models.finished:
            v = models.receive()
            if v is not None:
                views = memory.in_block(state["t00"].data_ptr(), 4)  # the host's channel
                reads.append((v, uniform_value(state), views))
            contexts.receive(ctx)  # total_step 0: takes what is there, does not wait
            ctx.trajectories = [index]
            contexts.send(ctx)
    except Exception as exc:  # noqa: BLE001  (reported to the test)
        end = type(exc).__name__
    out.put((index, reads, end))


def relay_rank(go, out):
    """Rank 1: the host's relay (models and contexts) for two collectors (fork children)."""
    import torch.distributed as dist

    from torch_mp_ext.exchange import HostRelay

    dist.init_process_group("gloo")
    relay = HostRelay(_Stateful(big_state(4 << 20)), contexts=True)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=relay_collector,
                         args=(relay.channel, relay.context_channel, out, i)) for i in range(2)]
    for p in procs:
        p.start()
    go.put(True)
    try:
        relay.join(60)
        end = "finished"
    except Exception as exc:  # noqa: BLE001  (reported to the test)
        end = type(exc).__name__
    for p in procs:
        p.join(60)
    if end == "finished":
        relay.close()  # says goodbye to the learner's context exchange, which waits for it
    out.put(("relay", relay.version, end))
    os._exit(0)  # the group's store may have lived in a killed learner: no orderly teardown


class _Stateful(torch.nn.Module):
    """A module whose state_dict is the given dict of tensors (shared, not copied)."""

    def __init__(self, state):
        super().__init__()
        self._state = state

    def state_dict(self, *args, **kwargs):
        return self._state
