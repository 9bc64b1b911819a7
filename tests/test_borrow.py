"""Collectors that read in place (StateDictChannel.borrow_into, ModelExchanger(copy=False)):
views of the published version, pinned while used, never torn, bounded by the pool, and
released by a collector's death."""

from __future__ import annotations

import os
import signal
import threading
import time

import _borrow_workers as bw
import _exchange_workers as w
import pytest
import torch

import torch_mp_ext as mp
from torch_mp_ext import _C
from torch_mp_ext.errors import BorrowedWriteError
from torch_mp_ext.sharing import memory

MB = 1 << 20


def pins(ch):
    """(pid, pinned buffer index + 1) of every reader slot in use."""
    return ch._debug_state()["readers"]


def in_channel(t):
    return memory.in_block(t.data_ptr(), t.numel() * t.element_size())


def trained_net():
    torch.manual_seed(0)
    net = w.Net()
    net.train()
    net(torch.randn(32, 64))  # BatchNorm statistics and num_batches_tracked change
    return net.eval()


def test_a_borrowed_model_views_the_version_and_computes_like_a_copy():
    learner = trained_net()
    ch = mp.StateDictChannel(learner)
    ch.publish(learner)
    copied, borrowed, other = w.Net().eval(), w.Net().eval(), w.Net().eval()
    params = {k: id(p) for k, p in borrowed.named_parameters()}
    ch.read_into(copied)
    assert ch.borrow_into(borrowed) == 0 and ch.borrow_into(other) == 0
    x = torch.randn(16, 64)
    with torch.no_grad():
        assert torch.equal(borrowed(x), copied(x)) and torch.equal(borrowed(x), learner(x))
    # the same Parameter objects (an optimizer's references stay valid), requires_grad kept
    assert {k: id(p) for k, p in borrowed.named_parameters()} == params
    assert all(p.requires_grad for p in borrowed.parameters())
    assert not any(b.requires_grad for b in borrowed.buffers())
    # no copy: both collectors view the one buffer in shared memory
    for (k, a), b in zip(borrowed.state_dict().items(), other.state_dict().values()):
        assert in_channel(a) and a.data_ptr() == b.data_ptr(), k
    assert not any(in_channel(t) for t in copied.state_dict().values())
    version, state = ch.borrow()
    assert version == 0 and all(torch.equal(state[k], t)
                                for k, t in learner.state_dict().items())
    assert len(pins(ch)) == 3  # two models and one state_dict, each with its own pin
    del state
    assert len(pins(ch)) == 2


def test_the_pin_lasts_while_any_view_lives_and_release_copies():
    template = bw.state_of(MB)
    ch = mp.StateDictChannel(template)
    ch.publish(template)
    version, state = ch.borrow()
    kept = state["t3"]
    del state
    assert [pid for pid, _ in pins(ch)] == [os.getpid()]  # one view still lives
    del kept
    assert pins(ch) == []
    model = bw.Flat(MB)
    assert ch.release(model) is False  # nothing borrowed yet
    ch.borrow_into(model)
    assert len(pins(ch)) == 1 and in_channel(model.t0)
    assert ch.release(model) is True
    assert pins(ch) == [] and not in_channel(model.t0) and w.uniform_value(model) == 0
    ch.borrow_into(model)
    ch.publish(template)
    ch.borrow_into(model, newer_than=0)  # the next version: the first one is let go
    assert len(pins(ch)) == 1 and pins(ch)[0][1] - 1 == ch._channel.state()["stamps"].index(2)


def test_a_write_into_borrowed_weights_raises_at_the_next_borrow():
    learner = trained_net()
    ch = mp.StateDictChannel(learner)
    ch.publish(learner)
    model = w.Net()
    ch.borrow_into(model)
    model.train()
    model(torch.randn(8, 64))  # BatchNorm writes its statistics and its count in place
    # its kernel updates the statistics without counting; the count is a counted add_
    with pytest.raises(BorrowedWriteError,
                       match=r"\['bn.num_batches_tracked'\].*model.eval\(\)"):
        ch.borrow_into(model)
    assert ch.borrow_into(model) == 0  # reported once; the model still views version 0
    with torch.no_grad():
        model.fc1.weight.add_(1)
    with pytest.raises(BorrowedWriteError, match=r"\['fc1.weight'\]"):
        ch.release(model)


def test_a_model_changed_between_borrows_is_planned_again():
    """Later versions reuse the first borrow's plan (Note [Borrow plans]) only while the
    model is the same tree of the same tensors; any change is seen at the next borrow."""
    learner = trained_net()
    ch = mp.StateDictChannel(learner)
    ch.publish(learner)
    model = w.Net().eval()
    ch.borrow_into(model)
    x = torch.randn(4, 64)
    # a replaced Parameter and a replaced submodule are rebound, not their orphans
    model.fc1.weight = torch.nn.Parameter(torch.zeros(256, 64))
    model.fc2 = torch.nn.Linear(256, 8)
    ch.publish(learner)
    assert ch.borrow_into(model, newer_than=0) == 1
    assert in_channel(model.fc1.weight) and in_channel(model.fc2.bias)
    with torch.no_grad():
        assert torch.equal(model(x), learner(x))
    # a graph that saved the old weights refuses to run its backward: set_ counts
    y = model.fc2(torch.ones(1, 256, requires_grad=True)).sum()
    ch.publish(learner)
    ch.borrow_into(model, newer_than=1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    del y  # its graph held version 1's fc2 weight
    # a new dtype on the same Parameter objects, or a new submodule, is refused as before
    model.double()
    with pytest.raises(ValueError, match="is torch.float64"):
        ch.borrow_into(model)
    model.float()
    model.extra = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="unexpected keys"):
        ch.borrow_into(model)
    del model.extra
    # after release, writes into a borrow made later are still found
    assert ch.release(model) is True
    ch.borrow_into(model)
    with torch.no_grad():
        model.fc2.bias.add_(1)
    with pytest.raises(BorrowedWriteError, match=r"\['fc2.bias'\]"):
        ch.borrow_into(model)
    del model
    assert pins(ch) == []


def test_bad_borrows_are_refused_naming_the_cause():
    ch = mp.StateDictChannel(w.Net())
    with pytest.raises(ValueError, match="copy=False is for receivers"):
        mp.ModelExchanger(w.Net(), role="learner", channel=ch, copy=False)
    with pytest.raises(ValueError, match="copy=False reads versions in place"):
        mp.PeriodicalModelExchanger(w.Net(), "receive", backend="gloo", copy=False)
    with pytest.raises(TypeError, match="copy must be True or False"):
        mp.ModelExchanger(w.Net(), role="collector", channel=ch, copy="no")
    with torch.inference_mode():
        frozen = w.Net()
    ch.publish(w.Net())
    with pytest.raises(ValueError, match="'fc1.weight' is an inference tensor"):
        ch.borrow_into(frozen)
    with pytest.raises(ValueError, match="missing keys"):
        ch.borrow_into({"fc1.weight": torch.zeros(256, 64)})
    assert pins(ch) == []


def test_the_pool_bounds_memory_and_pinned_versions_never_change():
    template = bw.state_of(MB)
    ch = mp.StateDictChannel(template, buffers=3)
    assert ch._channel.block.capacity >= _C.LatestChannel.required_bytes(3, ch.nbytes)
    capacity = ch._channel.block.capacity
    a, b = bw.Flat(MB), bw.Flat(MB)
    ch.publish(_filled(template, 0))
    ch.borrow_into(a)
    ch.publish(_filled(template, 1))
    ch.borrow_into(b)
    ch.publish(_filled(template, 2))  # the third buffer
    # the newest (2) is never written, 0 and 1 are pinned: the learner waits, then says why
    with pytest.raises(TimeoutError, match=rf"pinned by readers \(pids \[{os.getpid()}\]\)"):
        ch.publish(_filled(template, 3), timeout=0.2)
    assert w.uniform_value(a) == 0 and w.uniform_value(b) == 1  # never written under them
    assert ch.borrow_into(a, newer_than=0) == 2  # a moves on: version 0's buffer is free
    ch.publish(_filled(template, 3), timeout=5)
    assert w.uniform_value(b) == 1 and w.uniform_value(a) == 2
    assert ch._channel.block.capacity == capacity  # no buffer was added: the bound holds


def _filled(template, value):
    out = {k: torch.empty_like(v) for k, v in template.items()}
    w.fill_(out, value)
    return out


def test_borrowed_versions_are_never_torn_under_concurrent_publishes():
    nbytes, last = 2 * MB, 60
    ch = mp.StateDictChannel(bw.state_of(nbytes), buffers=4)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    collectors = [ctx.Process(target=bw.borrowing_collector,
                              args=(ch, nbytes, out, last, 0.002, 60)) for _ in range(2)]
    learner = ctx.Process(target=bw.publish_range, args=(ch, nbytes, range(last + 1), out))
    for p in collectors + [learner]:
        p.start()
    got = [out.get(timeout=90) for _ in range(3)]
    for p in collectors + [learner]:
        p.join(60)
        assert p.exitcode == 0
    seen = [s for role, s in got if role == "collector"]
    assert len(seen) == 2
    for reads in seen:
        versions = [v for v, _, _ in reads]
        assert versions == sorted(set(versions)) and versions[-1] == last
        # every tensor equals the version, when borrowed and after holding it while the
        # learner went on publishing
        assert all(v == first == after for v, first, after in reads), reads


def test_a_stalled_collector_does_not_stop_the_learner():
    nbytes = MB
    ch = mp.StateDictChannel(bw.state_of(nbytes), buffers=3)
    ch.publish(_filled(bw.state_of(nbytes), 0))
    ctx = mp.get_context("fork")
    out, go_on = ctx.Queue(), ctx.Event()
    stalled = ctx.Process(target=bw.borrow_and_stall, args=(ch, nbytes, out, go_on))
    stalled.start()
    try:
        assert out.get(timeout=30) == ("pinned", 0)
        slowest = 0.0
        for v in range(1, 21):
            start = time.monotonic()
            ch.publish(_filled(bw.state_of(nbytes), v), timeout=5)
            slowest = max(slowest, time.monotonic() - start)
        assert slowest < 1.0  # never waited for the stalled collector's pin
        assert ch.read()[0] == 20
    finally:
        go_on.set()
    assert out.get(timeout=30) == ("stalled", 0, 0)  # its version never changed under it
    stalled.join(30)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])  # spawn: slow tier (conftest)
def test_a_sigkilled_collector_releases_its_pin(ctx):
    nbytes = MB
    ch = mp.StateDictChannel(bw.state_of(nbytes), buffers=2)
    ch.publish(_filled(bw.state_of(nbytes), 0))
    out = ctx.Queue()
    p = ctx.Process(target=bw.borrow_and_sleep, args=(ch, nbytes, out))
    p.start()
    assert out.get(timeout=30) == ("pinned", 0)
    assert [pid for pid, _ in pins(ch)] == [p.pid]
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    ch.publish(_filled(bw.state_of(nbytes), 1))  # the other buffer
    start = time.monotonic()
    ch.publish(_filled(bw.state_of(nbytes), 2), timeout=10)  # needs the dead one's buffer
    assert time.monotonic() - start < 2.0  # reclaimed, not waited for
    assert pins(ch) == []
    version, state = ch.read()
    assert version == 2 and w.uniform_value(state) == 2


def test_a_copy_into_a_borrowing_model_never_writes_the_borrowed_version():
    template = bw.state_of(MB)
    ch = mp.StateDictChannel(template)
    ch.publish(_filled(template, 0))
    model, other = bw.Flat(MB), bw.Flat(MB)
    ch.borrow_into(model)
    ch.borrow_into(other)
    ch.publish(_filled(template, 1))
    assert ch.read_into(model) == 1  # a copy: the model gets private memory first
    assert not in_channel(model.t0) and w.uniform_value(model) == 1
    assert w.uniform_value(other) == 0  # version 0, still borrowed, untouched


def test_a_periodical_receiver_borrows_multiples_of_its_period():
    src, dst = bw.Flat(MB), bw.Flat(MB)
    ch = mp.StateDictChannel(src)
    sender = mp.PeriodicalModelExchanger(src, "send", period=2, channel=ch)
    receiver = mp.PeriodicalModelExchanger(dst, "receive", period=2, channel=ch, copy=False,
                                           timeout=5)
    for _ in range(4):  # iterations 0..3: versions 0 and 2 are published
        w.fill_(src, sender._id_counter)
        sender.send()
    assert receiver.receive() == 2 and w.uniform_value(dst) == 2 and in_channel(dst.t0)
    receiver.release()
    assert not in_channel(dst.t0) and w.uniform_value(dst) == 2 and pins(ch) == []


def test_a_waiting_writer_and_a_reader_without_a_slot_wake_when_a_pin_goes():
    """Both sleep on the channel's 'released' condition (no polling) and wake on an unpin."""
    template = bw.state_of(1 << 16)
    ch = mp.StateDictChannel(template, buffers=2)
    ch.publish(_filled(template, 0))
    held = bw.Flat(1 << 16)
    ch.borrow_into(held)  # pins version 0's buffer
    ch.publish(_filled(template, 1))  # the other buffer: the newest, never written
    done = []
    writer = threading.Thread(target=lambda: done.append(
        ch.publish(_filled(template, 2), timeout=30)))
    writer.start()
    time.sleep(0.2)
    assert not done  # every back buffer is pinned: it waits
    start = time.monotonic()
    ch.release(held)
    writer.join(30)
    assert done == [2] and time.monotonic() - start < 1.0
    borrows = [ch.borrow()[1] for _ in range(128)]  # every reader slot pinned
    with pytest.raises(TimeoutError, match=r"every one of the 128 reader slots"):
        ch.read(timeout=0.1)
    threading.Timer(0.2, borrows.pop).start()
    start = time.monotonic()
    assert ch.read(timeout=30)[0] == 2
    assert 0.1 < time.monotonic() - start < 1.5
    del borrows
    assert pins(ch) == []
