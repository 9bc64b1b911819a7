"""Start-method contexts whose processes and queues share tensors through torch_mp_ext.

Adapted from CPython 3.11 ``Lib/multiprocessing/context.py``; changes: the concrete contexts
use torch_mp_ext's ``Process`` classes (which carry the sharing strategy to their children,
:mod:`.process`), ``"forkserver"`` is torch_mp_ext's fast forkserver (:mod:`.forkserver`),
``get_context`` on any of them returns torch_mp_ext's contexts, and the default context
follows the standard library's start-method choice instead of keeping a second one, so
``torch_mp_ext.set_start_method`` and ``multiprocessing.set_start_method`` are the same switch.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing import context as _ctx
from typing import Any

from .. import queues
from . import forkserver
from .process import ForkProcess, SpawnProcess, StrategyCarrier

__all__ = [
    "DefaultContext",
    "ForkContext",
    "ForkServerContext",
    "Process",
    "SpawnContext",
    "default_context",
    "is_ours",
]


class Process(StrategyCarrier, _ctx.Process):
    """``multiprocessing.Process`` of the default context, carrying the sharing strategy."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802  (multiprocessing's name)
        ctx: Any = default_context.get_context()
        return ctx.Process._Popen(process_obj)

    @staticmethod
    def _after_fork() -> Any:
        ctx: Any = default_context.get_context()
        return ctx.Process._after_fork()


class _Context:
    """What torch_mp_ext's concrete contexts add to the standard library's: the crash-safe
    shared-memory queues of :mod:`torch_mp_ext.queues` (so ``Pool``, ``DataLoader`` and code
    written for ``multiprocessing`` use them unchanged), and ``get_context`` returning
    torch_mp_ext's contexts (``get_context("spawn").get_context("fork")`` is ours too)."""

    def Queue(self, maxsize: int = 0, *, max_bytes: int | None = None) -> Any:  # noqa: N802
        """Returns a :class:`torch_mp_ext.queues.Queue`."""
        return queues.Queue(maxsize, max_bytes=max_bytes, ctx=self)

    def JoinableQueue(  # noqa: N802
        self, maxsize: int = 0, *, max_bytes: int | None = None
    ) -> Any:
        """Returns a :class:`torch_mp_ext.queues.JoinableQueue`."""
        return queues.JoinableQueue(maxsize, max_bytes=max_bytes, ctx=self)

    def SimpleQueue(self, *, max_bytes: int | None = None) -> Any:  # noqa: N802
        """Returns a :class:`torch_mp_ext.queues.SimpleQueue`."""
        return queues.SimpleQueue(max_bytes=max_bytes, ctx=self)

    def get_context(self, method: str | None = None) -> Any:
        """This context (``method=None``) or torch_mp_ext's context for ``method``."""
        if method is None:
            return self
        return _concrete(method)

    def set_forkserver_preload(self, module_names: list[str]) -> None:
        """Modules the forkserver imports before forking workers (at its next start)."""
        forkserver.set_preload(module_names)


class ForkContext(_Context, _ctx.ForkContext):
    Process = ForkProcess  # type: ignore[assignment]


class SpawnContext(_Context, _ctx.SpawnContext):
    Process = SpawnProcess  # type: ignore[assignment]


class ForkServerContext(_Context, _ctx.ForkServerContext):
    """``"forkserver"``: workers fork from torch_mp_ext's fast server (:mod:`.forkserver`)."""

    Process = forkserver.ForkServerProcess  # type: ignore[assignment]


_concrete_contexts: dict[str, _ctx.BaseContext] = {
    "fork": ForkContext(),
    "spawn": SpawnContext(),
    "forkserver": ForkServerContext(),
}


def _concrete(method: str) -> Any:
    try:
        ctx = _concrete_contexts[method]
    except KeyError:
        raise ValueError(f"cannot find context for {method!r}") from None
    ctx._check_available()  # type: ignore[attr-defined]
    return ctx


def is_ours(ctx: Any) -> bool:
    """True if ``ctx`` is one of torch_mp_ext's concrete contexts (``get_context(m)``)."""
    return isinstance(ctx, _Context)


class DefaultContext(_ctx.BaseContext):
    """The context behind torch_mp_ext's module-level functions.

    The start method is the standard library's (``multiprocessing.get_start_method()``);
    the context returned for it is torch_mp_ext's.
    """

    Process = Process

    def get_context(  # type: ignore[override]  # the stdlib stub overloads per method
        self, method: str | None = None
    ) -> _ctx.BaseContext:
        """torch_mp_ext's context for ``method`` (default: the current start method)."""
        return _concrete(multiprocessing.get_start_method() if method is None else method)

    def get_start_method(  # type: ignore[override]  # as the stdlib's, unoverloaded
        self, allow_none: bool = False
    ) -> str | None:
        """The standard library's current start method (``multiprocessing``'s own)."""
        return multiprocessing.get_start_method(allow_none)

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        """Sets the standard library's start method, which this context follows."""
        multiprocessing.set_start_method(method, force)

    def get_all_start_methods(self) -> list[str]:
        """The start methods this platform offers."""
        return multiprocessing.get_all_start_methods()

    def set_forkserver_preload(self, module_names: list[str]) -> None:
        """Modules torch_mp_ext's forkserver imports before it forks workers."""
        forkserver.set_preload(module_names)

    # Queue-like factories follow the concrete context, so torch_mp_ext's overrides apply.
    def Queue(self, maxsize: int = 0, **kwargs: Any) -> Any:  # noqa: N802 (stdlib name)
        """A :class:`~torch_mp_ext.queues.Queue` of the current start method's context."""
        return self.get_context().Queue(maxsize, **kwargs)

    def JoinableQueue(self, maxsize: int = 0, **kwargs: Any) -> Any:  # noqa: N802
        """A :class:`~torch_mp_ext.queues.JoinableQueue` of the current context."""
        return self.get_context().JoinableQueue(maxsize, **kwargs)

    def SimpleQueue(self, **kwargs: Any) -> Any:  # noqa: N802
        """A :class:`~torch_mp_ext.queues.SimpleQueue` of the current context."""
        return self.get_context().SimpleQueue(**kwargs)


default_context = DefaultContext()
"""The context the top-level names (``mp.Process``, ``mp.Queue``, ``mp.get_context`` ...) are
bound to, as ``multiprocessing`` binds them to its own default context.

Example:
    ```python
    import torch_mp_ext as mp
    from torch_mp_ext.processes import default_context

    ctx = default_context.get_context("forkserver")   # what mp.get_context returns
    assert type(ctx) is type(mp.get_context("forkserver"))
    ```
"""
