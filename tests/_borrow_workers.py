"""Module-level child targets for tests/test_borrow.py (collectors that read in place)."""

from __future__ import annotations

import time

import torch
from _exchange_workers import fill_, uniform_value

from torch_mp_ext.exchange import ModelExchanger


def state_of(nbytes: int, ntensors: int = 8) -> dict[str, torch.Tensor]:
    n = nbytes // 4 // ntensors
    return {f"t{i}": torch.zeros(n) for i in range(ntensors)}


class Flat(torch.nn.Module):
    """A model whose parameters are the tensors of :func:`state_of`."""

    def __init__(self, nbytes: int, ntensors: int = 8) -> None:
        super().__init__()
        for key, t in state_of(nbytes, ntensors).items():
            self.register_parameter(key, torch.nn.Parameter(t))


def borrowing_collector(ch, nbytes, out, last, hold_s, deadline_s):
    """Borrows newer versions until ``last``; after each, checks that every tensor equals
    the version, holds it ``hold_s`` (the learner keeps publishing), and checks again."""
    model = Flat(nbytes)
    models = ModelExchanger(model, role="collector", channel=ch, copy=False,
                            timeout=deadline_s)
    seen, deadline = [], time.monotonic() + deadline_s
    while models.version < last and time.monotonic() < deadline:
        if models.receive() is None:
            break
        v = models.version
        first = uniform_value(model)
        time.sleep(hold_s)
        seen.append((v, first, uniform_value(model)))
    out.put(("collector", seen))


def publish_range(ch, nbytes, versions, out):
    """Publishes each version with every tensor filled with it, then closes the channel (a
    finish, not a death: collectors still take what is there); reports the slowest publish."""
    state = state_of(nbytes)
    slowest = 0.0
    for v in versions:
        fill_(state, v)
        start = time.monotonic()
        ch.publish(state, v, timeout=30)
        slowest = max(slowest, time.monotonic() - start)
    ch.close()
    out.put(("learner", slowest))


def borrow_and_stall(ch, nbytes, out, go_on):
    """Borrows the newest version, reports it, then stalls (alive) until ``go_on`` is set,
    and reports what its model holds then."""
    model = Flat(nbytes)
    models = ModelExchanger(model, role="collector", channel=ch, copy=False, timeout=30)
    out.put(("pinned", models.receive()))
    go_on.wait(60)
    out.put(("stalled", models.version, uniform_value(model)))


def borrow_and_sleep(ch, nbytes, out):
    """Borrows the newest version, reports it, then sleeps until killed."""
    model = Flat(nbytes)
    models = ModelExchanger(model, role="collector", channel=ch, copy=False, timeout=30)
    out.put(("pinned", models.receive()))
    time.sleep(120)
