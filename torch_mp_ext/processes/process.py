"""Process classes that carry the sharing strategy to their children.

Note [OpenMP after fork]
libgomp (torch's CPU thread pool) cannot be used in a child forked after the parent ran a
parallel op: the child's first parallel op waits forever for threads that only existed in the
parent (torch.multiprocessing hangs there). Children forked by torch_mp_ext's Process run torch
with one intra-op thread, as DataLoader workers do; spawn and forkserver children are
untouched. The flag is set in the parent just around fork and read by an at-fork hook.
This is a drop-in difference: ``torch.get_num_threads()`` is 1 in every such child, not the
parent's count. Workers of tiny ops run several times faster for it (no waiting for a second
OpenMP thread on CPUs that other workers use), which changes the course of each run of an
asynchronous (Hogwild) program but not measurably the distribution of its results (issue 36,
``tools/a3c_ab.py``, docs/troubleshooting.md "Asynchronous training learns differently").

Note [Strategy inheritance]
torch.multiprocessing's sharing strategy is a per-process global: spawn and forkserver
children start with ``file_descriptor`` whatever the parent chose (anchor F3). Our ``Process``
records the parent's strategy when it starts, in its own state; a spawn/forkserver child
unpickles that state before running anything and applies it. Fork children inherit it anyway.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import context as _ctx
from typing import Any, Optional

import torch

from ..sharing import byvalue, pickling
from ..sharing import memory as _memory
from ..sharing import strategy as sharing
from . import dataloader, forkcheck, payload, popen_spawn

__all__ = ["ForkProcess", "SpawnProcess", "StrategyCarrier"]


_forking_our_child = False


def _after_fork_in_child() -> None:
    global _forking_our_child
    if _forking_our_child:  # Note [OpenMP after fork]
        _forking_our_child = False
        torch.set_num_threads(1)


os.register_at_fork(after_in_child=_after_fork_in_child)


class StrategyCarrier:
    """Mixin for Process classes: Note [Strategy inheritance], Note [OpenMP after fork]."""

    def start(self) -> None:
        global _forking_our_child
        self._tmx_sharing_strategy = sharing.get_sharing_strategy()
        method = getattr(self, "_start_method", None) or multiprocessing.get_start_method()
        if method == "fork":
            forkcheck.check()  # Note [Fork after threads]
        _forking_our_child = method == "fork"
        try:
            super().start()  # type: ignore[misc]
        finally:
            _forking_our_child = False

    def join(self, timeout: Optional[float] = None) -> None:
        super().join(timeout)  # type: ignore[misc]
        code = self.exitcode  # type: ignore[attr-defined]
        if code is not None and not getattr(self, "_tmx_reclaimed", False):
            self._tmx_reclaimed = True
            _memory.reclaim_after_death()

    def run(self) -> None:
        # Note [Batches born in the arena] (dataloader.py): only DataLoader worker processes.
        if dataloader.is_worker_loop(getattr(self, "_target", None)):
            dataloader.install()
        super().run()  # type: ignore[misc]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        # Note [By-value fallback] (sharing/byvalue.py): what the child runs (target, args,
        # kwargs) is pickled plainly, as before, unless the probe finds a lambda, a local or
        # an unimportable __main__ object among them, or a plain attempt failed
        # (popen_spawn.dump_process): then it travels as one by-value pickle.
        first = state.pop("_tmx_by_value", None)
        if _ctx.get_spawning_popen() is not None and "_target" in state:
            call = (state["_target"], state["_args"], state["_kwargs"])
            if first is not None or byvalue.probe((call[0], *call[1], *call[2].values())):
                data = byvalue.by_value(call, first if isinstance(first, BaseException) else None)
                if data is not None:
                    del state["_target"], state["_args"], state["_kwargs"]
                    state["_tmx_call"] = data
                    guard = getattr(_ctx.get_spawning_popen(), "_tmx_payload_guard", None)
                    if guard is not None:
                        guard.add_inner(data)
        marker = payload.opened_marker(_ctx.get_spawning_popen(), state)
        if marker is not None:  # Note [Unopened payloads]: unpickled first, so it goes first
            state = {"_tmx_opened": marker, **state}
        return state

    def __setstate__(self, state: dict) -> None:
        call = state.pop("_tmx_call", None)
        state.pop("_tmx_opened", None)  # Note [Unopened payloads]: did its work when unpickled
        self.__dict__.update(state)
        strategy = state.get("_tmx_sharing_strategy")
        if strategy is not None and strategy != sharing.get_sharing_strategy():
            sharing.set_sharing_strategy(strategy)
        if call is not None:  # after the strategy: the arguments' tensors follow it
            self._target, self._args, self._kwargs = pickling.loads(call)


class ForkProcess(StrategyCarrier, _ctx.ForkProcess):
    pass


class SpawnProcess(StrategyCarrier, _ctx.SpawnProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802 (multiprocessing's name)
        return popen_spawn.Popen(process_obj)  # Note [A main module read from stdin]
