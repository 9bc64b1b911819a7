"""ModelExchanger, PeriodicalModelExchanger and ContextExchanger: the seed's semantics in one
process, then a learner and two collectors running a toy training loop for real."""

from __future__ import annotations

import logging
import os
import time

import _exchange_workers as w
import pytest
import torch

import torch_mp_ext as mp
from torch_mp_ext.exchange import Context, run_step

LOGGER = "torch_mp_ext"


def pair(**receiver_args):
    """A learner's and a collector's ModelExchanger on one channel, in this process."""
    ch = mp.StateDictChannel(w.Net())
    src, dst = w.Net(), w.Net()
    w.fill_(dst, -1.0)
    learner = mp.ModelExchanger(src, role="learner", channel=ch)
    collector = mp.ModelExchanger(dst, role="collector", channel=ch, **receiver_args)
    return src, dst, learner, collector


def periodical(period=1, **receiver_args):
    ch = mp.StateDictChannel(w.Net())
    src, dst = w.Net(), w.Net()
    sender = mp.PeriodicalModelExchanger(src, "send", period=period, channel=ch)
    receiver = mp.PeriodicalModelExchanger(dst, "receive", channel=ch, **receiver_args)
    return src, dst, sender, receiver


def send_filled(sender, model):
    """One sender iteration with the model filled with the iteration's index."""
    w.fill_(model, sender._id_counter)
    return sender.send()


def test_model_exchanger_loads_the_newest_model_and_warns_naming_the_process(caplog):
    src, dst, learner, collector = pair(timeout=0.1)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert collector.receive() is None  # nothing published yet
    assert "Timeout when waiting for new model!" in caplog.text
    assert f"(pid {os.getpid()}, role collector)" in caplog.text
    for value in (5, 6):
        w.fill_(src, value)
        learner.send()
    assert collector.receive() == 1 and w.uniform_value(dst) == 6  # the newest, once
    caplog.clear()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, LOGGER):
        assert collector.receive(timeout=0.2) is None  # waits for one newer than 1
    assert time.monotonic() - start >= 0.2 and "no version newer than 1" in caplog.text
    learner.close()
    start = time.monotonic()
    assert collector.receive(timeout=30) is None and collector.finished
    assert time.monotonic() - start < 5


def test_model_exchanger_middleware_skips_the_first_iteration():
    src, dst, learner, collector = pair(timeout=0.1)
    w.fill_(src, 3)
    gen = learner(Context())
    next(gen)  # the learner's step runs here
    with pytest.raises(StopIteration):
        next(gen)  # ... then it sends
    run_step(Context(total_step=0), collector)
    assert collector.version == -1 and w.uniform_value(dst) == -1
    run_step(Context(total_step=1), collector)
    assert collector.version == 0 and w.uniform_value(dst) == 3


def test_periodical_sender_publishes_every_period_iterations():
    src, _dst, sender, receiver = periodical(period=3)
    sent = [send_filled(sender, src) for _ in range(7)]
    assert sent == [0, None, None, 3, None, None, 6]
    assert receiver._channel.version == 6
    ctx = Context()
    for _ in range(2):  # as middleware: the send comes after the step
        run_step(ctx, sender)
    assert receiver._channel.version == 6 and sender._id_counter == 9


def test_periodical_receiver_reuses_weights_up_to_stale_toleration(caplog):
    src, dst, sender, receiver = periodical(stale_toleration=3, timeout=0.1)
    send_filled(sender, src)
    assert receiver.receive() == 0 and receiver.model_stale == 1
    start = time.monotonic()
    assert receiver.receive() is None and receiver.model_stale == 2  # reuse, no wait
    assert receiver.receive() is None and receiver.model_stale == 3
    assert time.monotonic() - start < 0.1
    with caplog.at_level(logging.WARNING, LOGGER):
        assert receiver.receive() is None  # stale 3 is not < 3: wait, time out, warn
    assert receiver.model_stale == 4 and "Timeout when waiting for new model!" in caplog.text
    send_filled(sender, src)
    assert receiver.receive() == 1 and receiver.model_stale == 1 and w.uniform_value(dst) == 1


def test_periodical_receiver_refuses_models_older_than_delay_toleration():
    src, dst, sender, receiver = periodical(delay_toleration=0.3, stale_toleration=5,
                                            timeout=0.1)
    send_filled(sender, src)
    assert receiver.receive() == 0
    time.sleep(0.35)
    start = time.monotonic()
    assert receiver.receive() is None  # stale 1 < 5, but the last model is too old: wait
    assert time.monotonic() - start >= 0.1
    send_filled(sender, src)
    time.sleep(0.35)
    assert receiver.receive() is None  # version 1 is newer, but too old to load
    assert receiver.model_id == 0 and w.uniform_value(dst) == 0
    send_filled(sender, src)
    assert receiver.receive() == 2 and w.uniform_value(dst) == 2


def test_periodical_receiver_takes_only_multiples_of_its_period():
    src, dst, sender, receiver = periodical(period=1, timeout=0.1)
    receiver._period = 2  # a receiver configured with another period than the sender
    for _ in range(2):
        send_filled(sender, src)
    assert receiver.receive() == 0
    for _ in range(2):
        send_filled(sender, src)
    assert receiver.receive() == 2 and w.uniform_value(dst) == 2  # 3 is newer, but odd


def test_bad_arguments_are_value_errors():
    model = w.Net()
    ch = mp.StateDictChannel(model)
    with pytest.raises(ValueError, match="role must be one of"):
        mp.ModelExchanger(model, role="actor", channel=ch)
    with pytest.raises(ValueError, match="needs channel="):
        mp.ModelExchanger(model, role="learner")
    with pytest.raises(ValueError, match="model_loader is not supported"):
        mp.ModelExchanger(model, object(), role="learner", channel=ch)
    with pytest.raises(ValueError, match="mode must be one of"):
        mp.PeriodicalModelExchanger(model, "push", channel=ch)
    with pytest.raises(ValueError, match="period must be a positive integer"):
        mp.PeriodicalModelExchanger(model, "send", period=0, channel=ch)
    with pytest.raises(ValueError, match="storage_loader is not supported"):
        mp.ContextExchanger(1, object(), role="learner", channel=None)
    with pytest.raises(RuntimeError, match="not initialised"):
        mp.ModelExchanger(model, role="learner", backend="gloo")
    with pytest.raises(ValueError, match="backend must be"):
        mp.ModelExchanger(model, role="learner", backend="mpi")
    other = mp.StateDictChannel({"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="missing keys"):
        mp.ModelExchanger(model, role="learner", channel=other).send()


def test_context_exchanger_merges_trajectories_and_increments(caplog):
    channel = mp.ContextChannel()
    learner = mp.ContextExchanger(role="learner", channel=channel, timeout=5)
    collectors = [mp.ContextExchanger(role="collector", channel=channel, timeout=0.1)
                  for _ in range(2)]
    for i, c in enumerate(collectors):
        for step in range(2):
            ctx = Context(total_step=step, env_step=(step + 1) * 10, env_episode=step + 1,
                          trajectories=[(i, step)])
            assert c.send(ctx) == {"trajectories": [(i, step)], "env_step": 10, "env_episode": 1}
    ctx = Context(env_step=100, train_iter=7)
    merged = []
    while len(merged) < 4:
        ctx.trajectories = None
        assert learner.receive(ctx)
        merged += ctx.trajectories
    assert sorted(merged) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert (ctx.env_step, ctx.env_episode) == (140, 4)  # increments summed into its own
    assert learner.send(ctx) == {"train_iter": 7}
    down = Context(total_step=0)
    assert collectors[0].receive(down) and down.train_iter == 7
    start = time.monotonic()
    assert not collectors[0].receive(Context(total_step=0))  # before skip_n_iter: no wait
    assert time.monotonic() - start < 0.1
    with caplog.at_level(logging.WARNING, LOGGER):
        assert not collectors[0].receive(Context(total_step=1))  # waits for a new one
    assert "Timeout when waiting for new context!" in caplog.text
    learner.put({"train_iter": 1, "bogus": 2})
    assert "Receive unexpected key (bogus)" in caplog.text
    with pytest.raises(ValueError, match="make it with capacity >="):
        learner.send(Context(train_iter=b"x" * (1 << 17)))  # type: ignore[arg-type]
    learner.close()
    assert collectors[1].receive(Context(total_step=5))  # sent before the close: still there
    start = time.monotonic()
    assert not collectors[1].receive(Context(total_step=6), timeout=30)
    assert collectors[1].finished and time.monotonic() - start < 5


def run_children(ctx, procs, out, timeout=90):
    for p in procs:
        p.start()
    results = [out.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return results


def test_learner_and_two_collectors_train_and_exchange():
    ctx = mp.get_context("fork")
    model_ch = mp.StateDictChannel(w.Net())
    ctx_ch = mp.ContextChannel(ctx=ctx)
    out = ctx.Queue()
    expected = 2 * w.STEPS * 3
    procs = [ctx.Process(target=w.learner, args=(model_ch, ctx_ch, out, expected))]
    procs += [ctx.Process(target=w.collector, args=(i, model_ch, ctx_ch, out)) for i in range(2)]
    results = run_children(ctx, procs, out)
    (_, published, merged, env_step, env_episode, _train_iter), = [r for r in results
                                                                  if r[0] == "learner"]
    assert published == list(range(len(published)))
    assert merged == sorted((i, s, k) for i in range(2) for s in range(w.STEPS) for k in range(3))
    assert (env_step, env_episode) == (2 * w.STEPS * 10, 2 * w.STEPS)
    for _, _index, loads, train_iters in (r for r in results if r[0] == "collector"):
        versions = [v for v, _ in loads]
        assert len(loads) == w.STEPS - 1  # every step but the first loaded a newer model
        assert versions == sorted(set(versions)) and set(versions) <= set(published)
        assert all(value == v for v, value in loads), loads  # exactly one published version
        assert train_iters == sorted(train_iters) and train_iters[-1] > 0


def test_periodical_exchange_across_processes():
    ctx = mp.get_context("fork")
    model_ch = mp.StateDictChannel(w.Net())
    out = ctx.Queue()
    period, stale = 2, 2
    procs = [ctx.Process(target=w.periodic_sender, args=(model_ch, out, 40, period, 0.02))]
    procs += [ctx.Process(target=w.periodic_receiver,
                          args=(i, model_ch, out, period, stale, 0.015)) for i in range(2)]
    results = run_children(ctx, procs, out)
    (_, sent), = [r for r in results if r[0] == "sender"]
    assert sent == list(range(0, 40, period))
    for _, _index, steps in (r for r in results if r[0] == "receiver"):
        loads = [loaded for loaded, _, _ in steps if loaded is not None]
        assert len(loads) > 5 and loads == sorted(set(loads)) and set(loads) <= set(sent)
        assert any(loaded is None and s == stale for loaded, s, _ in steps[1:])  # reused
        current = -1
        for loaded, stale_now, value in steps:
            current = loaded if loaded is not None else current
            assert stale_now == 1 if loaded is not None else stale_now <= stale
            assert current < 0 or value == current  # the model is one version, whole


def test_a_learner_killed_is_a_peer_death_not_a_finish():
    """Issue 26: ``while not ex.finished: ex.receive()`` left its loop with finished == True
    after the learner was SIGKILLed. Both exchangers must raise PeerDiedError instead, at
    once (a waiting collector is woken, not left to its 30 s timeout)."""
    ctx = mp.get_context("fork")
    model_ch = mp.StateDictChannel(w.Net())
    ctx_ch = mp.ContextChannel(ctx=ctx)
    go, out = ctx.Queue(), ctx.Queue()
    learner = ctx.Process(target=w.dying_learner, args=(model_ch, ctx_ch, go))
    collector = ctx.Process(target=w.collector_until_finished, args=(model_ch, ctx_ch, go, out))
    start = time.monotonic()
    learner.start()
    collector.start()
    version, ends = out.get(timeout=60)
    for p in (learner, collector):
        p.join(30)
    assert learner.exitcode == -9 and collector.exitcode == 0
    assert version == 0
    assert [kind for kind, _ in ends] == ["PeerDiedError", "PeerDiedError"], ends
    assert f"(pid {learner.pid}) died without closing it" in ends[0][1]
    assert time.monotonic() - start < 25  # woken by the death, not by the 30 s timeouts
    assert model_ch.publisher_died and not model_ch.closed
    with pytest.raises(mp.errors.PeerDiedError, match="died without closing"):
        model_ch.read_into(w.Net(), 0, timeout=5)
