"""Start-method contexts whose processes and queues share tensors through torch_mp_ext.

Adapted from CPython 3.11 ``Lib/multiprocessing/context.py``; changes: the concrete contexts
use torch_mp_ext's ``Process`` classes (which carry the sharing strategy to their children),
and the default context follows the standard library's start-method choice instead of
keeping a second one, so ``torch_mp_ext.set_start_method`` and
``multiprocessing.set_start_method`` are the same switch.

Note [OpenMP after fork]
libgomp (torch's CPU thread pool) cannot be used in a child forked after the parent ran a
parallel op: the child's first parallel op waits forever for threads that only existed in the
parent (torch.multiprocessing hangs there). Children forked by torch_mp_ext's Process run torch
with one intra-op thread, as DataLoader workers do; spawn and forkserver children are
untouched. The flag is set in the parent just around fork and read by an at-fork hook.

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

from . import _memory, sharing

__all__ = [
    "DefaultContext",
    "ForkContext",
    "ForkServerContext",
    "Process",
    "SpawnContext",
    "default_context",
]


_forking_our_child = False


def _after_fork_in_child() -> None:
    global _forking_our_child
    if _forking_our_child:  # Note [OpenMP after fork]
        _forking_our_child = False
        torch.set_num_threads(1)


os.register_at_fork(after_in_child=_after_fork_in_child)


class _StrategyCarrier:
    """Mixin for Process classes: Note [Strategy inheritance], Note [OpenMP after fork]."""

    def start(self) -> None:
        global _forking_our_child
        self._tmx_sharing_strategy = sharing.get_sharing_strategy()
        method = getattr(self, "_start_method", None) or default_context.get_start_method()
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

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        strategy = state.get("_tmx_sharing_strategy")
        if strategy is not None and strategy != sharing.get_sharing_strategy():
            sharing.set_sharing_strategy(strategy)


class ForkProcess(_StrategyCarrier, _ctx.ForkProcess):
    pass


class SpawnProcess(_StrategyCarrier, _ctx.SpawnProcess):
    pass


class ForkServerProcess(_StrategyCarrier, _ctx.ForkServerProcess):
    pass


class Process(_StrategyCarrier, _ctx.Process):
    """``multiprocessing.Process`` of the default context, carrying the sharing strategy."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802  (multiprocessing's name)
        ctx: Any = default_context.get_context()
        return ctx.Process._Popen(process_obj)

    @staticmethod
    def _after_fork() -> Any:
        ctx: Any = default_context.get_context()
        return ctx.Process._after_fork()


class _QueueFactories:
    """Queue constructors of torch_mp_ext's contexts: the crash-safe shared-memory queues of
    :mod:`torch_mp_ext.queues`, so ``Pool``, ``DataLoader`` and code written for
    ``multiprocessing`` use them unchanged."""

    def Queue(self, maxsize: int = 0, *, max_bytes: int | None = None) -> Any:  # noqa: N802
        """Returns a :class:`torch_mp_ext.queues.Queue`."""
        from .queues import Queue

        return Queue(maxsize, max_bytes=max_bytes, ctx=self)

    def JoinableQueue(  # noqa: N802
        self, maxsize: int = 0, *, max_bytes: int | None = None
    ) -> Any:
        """Returns a :class:`torch_mp_ext.queues.JoinableQueue`."""
        from .queues import JoinableQueue

        return JoinableQueue(maxsize, max_bytes=max_bytes, ctx=self)

    def SimpleQueue(self, *, max_bytes: int | None = None) -> Any:  # noqa: N802
        """Returns a :class:`torch_mp_ext.queues.SimpleQueue`."""
        from .queues import SimpleQueue

        return SimpleQueue(max_bytes=max_bytes, ctx=self)


class ForkContext(_QueueFactories, _ctx.ForkContext):
    Process = ForkProcess  # type: ignore[assignment]


class SpawnContext(_QueueFactories, _ctx.SpawnContext):
    Process = SpawnProcess  # type: ignore[assignment]


class ForkServerContext(_QueueFactories, _ctx.ForkServerContext):
    Process = ForkServerProcess  # type: ignore[assignment]


_concrete_contexts: dict[str, _ctx.BaseContext] = {
    "fork": ForkContext(),
    "spawn": SpawnContext(),
    "forkserver": ForkServerContext(),
}


class DefaultContext(_ctx.BaseContext):
    """The context behind torch_mp_ext's module-level functions.

    The start method is the standard library's (``multiprocessing.get_start_method()``);
    the context returned for it is torch_mp_ext's.
    """

    Process = Process

    def get_context(  # type: ignore[override]  # the stdlib stub overloads per method
        self, method: str | None = None
    ) -> _ctx.BaseContext:
        if method is None:
            method = multiprocessing.get_start_method()
        try:
            return _concrete_contexts[method]
        except KeyError:
            raise ValueError(f"cannot find context for {method!r}") from None

    def get_start_method(  # type: ignore[override]  # as the stdlib's, unoverloaded
        self, allow_none: bool = False
    ) -> str | None:
        return multiprocessing.get_start_method(allow_none)

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        multiprocessing.set_start_method(method, force)

    def get_all_start_methods(self) -> list[str]:
        return multiprocessing.get_all_start_methods()

    # Queue-like factories follow the concrete context, so torch_mp_ext's overrides apply.
    def Queue(self, maxsize: int = 0, **kwargs: Any) -> Any:  # noqa: N802 (stdlib name)
        return self.get_context().Queue(maxsize, **kwargs)

    def JoinableQueue(self, maxsize: int = 0, **kwargs: Any) -> Any:  # noqa: N802
        return self.get_context().JoinableQueue(maxsize, **kwargs)

    def SimpleQueue(self, **kwargs: Any) -> Any:  # noqa: N802
        return self.get_context().SimpleQueue(**kwargs)


default_context = DefaultContext()
