"""Sharing strategies: names, errors, the mirror into torch, inheritance by children."""

from __future__ import annotations

import _workers
import pytest
import torch.multiprocessing as torch_mp

import torch_mp_ext as mp
from torch_mp_ext.errors import InvalidSharingStrategyError


@pytest.fixture(autouse=True)
def restore_strategy():
    before = mp.get_sharing_strategy()
    yield
    mp.set_sharing_strategy(before)


def test_names_and_default_match_torch():
    assert mp.get_all_sharing_strategies() == torch_mp.get_all_sharing_strategies()
    assert mp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}
    assert mp.get_sharing_strategy() == "file_descriptor"


def test_set_is_mirrored_into_torch_both_ways():
    mp.set_sharing_strategy("file_system")
    assert torch_mp.get_sharing_strategy() == "file_system"
    torch_mp.set_sharing_strategy("file_descriptor")
    assert mp.get_sharing_strategy() == "file_descriptor"


def test_unknown_strategy_is_a_value_error_listing_valid_names():
    with pytest.raises(ValueError, match=r"'file_descriptor', 'file_system'") as info:
        mp.set_sharing_strategy("shared_memory")
    assert isinstance(info.value, AssertionError)  # what torch 2.13 raises
    assert isinstance(info.value, InvalidSharingStrategyError)
    assert mp.get_sharing_strategy() == "file_descriptor"


@pytest.mark.parametrize("strategy", ["file_system", "file_descriptor"])
def test_children_inherit_the_strategy(ctx, strategy):
    mp.set_sharing_strategy(strategy)
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_workers.report_strategy, args=(q,))
    p.start()
    try:
        assert q.get() == strategy
    finally:
        p.join(60)
        q.close()
    assert p.exitcode == 0
