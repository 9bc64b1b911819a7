"""The drop-in surface: every name torch.multiprocessing 2.13 offers is here."""

from __future__ import annotations

import multiprocessing

import torch.multiprocessing as torch_mp

import torch_mp_ext as mp

# Names outside __all__ that torch.multiprocessing users and tests reach for (anchor §1.2).
TORCH_EXTRA_NAMES = [
    "spawn",
    "start_processes",
    "ProcessContext",
    "SpawnContext",
    "ProcessRaisedException",
    "ProcessExitedException",
    "ENV_VAR_PARALLEL_START",
    "_set_thread_name",
    "_get_thread_name",
    "_prctl_pr_set_pdeathsig",
    "reductions",
    "init_reductions",
]


def test_all_names_of_torch_multiprocessing_are_here():
    missing = [name for name in torch_mp.__all__ if not hasattr(mp, name)]
    assert missing == []
    assert sorted(mp.__all__) == sorted(torch_mp.__all__)


def test_stdlib_multiprocessing_names_are_here():
    assert [n for n in multiprocessing.__all__ if not hasattr(mp, n)] == []


def test_torch_attributes_outside_all_are_here():
    assert [n for n in TORCH_EXTRA_NAMES if not hasattr(mp, n)] == []


def test_reductions_mirror_torch_reductions():
    public = [n for n in dir(torch_mp.reductions) if not n.startswith("_")]
    torch_own = [n for n in public if getattr(getattr(torch_mp.reductions, n), "__module__", "")
                 == "torch.multiprocessing.reductions"]
    assert [n for n in torch_own if not hasattr(mp.reductions, n)] == []


def test_get_context_returns_ours_for_every_start_method():
    for method in ("fork", "spawn", "forkserver"):
        ctx = mp.get_context(method)
        assert ctx.get_start_method() == method
        assert ctx.Process.__module__.startswith("torch_mp_ext.processes.")


def test_start_method_is_the_stdlib_switch():
    ours = mp.get_start_method(allow_none=True)
    assert ours == multiprocessing.get_start_method(allow_none=True)
    assert mp.get_all_start_methods() == multiprocessing.get_all_start_methods()


def test_version_matches_extension():
    assert mp.__version__ == mp._C.__version__
