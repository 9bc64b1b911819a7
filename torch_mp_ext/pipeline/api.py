"""Pipelines of generator stages across processes: :func:`pipeline` and ``@stage``.

::

    source                stage 1: h(items)        stage 2: g(item), workers=2      consumer
    ──────                ─────────────────        ───────────────────────────      ────────
    xs() ──▶ [≤ buffer_size] ──▶ for x in items: ──▶ [lane 0] ──▶ g ──▶ [lane 0] ──▶ for r in
    own process,                     yield x * x  ──▶ [lane 1] ──▶ g ──▶ [lane 1] ──▶   pipe:
    or a thread here      (one process)            (round robin, order kept)         (here)

    every arrow is a crash-safe shared-memory queue; arrays and tensors cross as block handles
    END follows the last item; a failure travels in stream order and stops every process

``pipeline(source, *stages)`` starts one process per stage (``workers`` for per-item stages)
and returns an iterator over the last stage's results. A stage is a generator function
``stage(items)`` that iterates its input and yields results (the shape of the Stack Overflow
question this answers, any number of outputs per input), or a plain function ``stage(item)``
returning one result per item. ``@stage(buffer_size)`` makes generator functions compose
like the plain generators they replace: ``f(g(h(xs())))`` runs h, g and f in processes.

Note [Pipeline memory]
Each of the ``stages + 1`` queues holds at most ``buffer_size`` items, and each receiver holds
the one it works on; a producer makes its next item only once there is room for it (Note
[Produce into room] in ``pipeline/links.py``). A generator stage, like a consumer's ``for``
loop, briefly holds two inputs (its loop variable keeps the last while the next arrives). So
with one worker per stage about ``(stages + 1) * (buffer_size + 1)`` items, and at most
``(stages + 1) * (buffer_size + 2)``, exist at once however long the stream (measured in
tests/test_pipeline.py): a block freed by its receiver returns to its owner's
pool and becomes that owner's next item. Workers multiply their stage's share; the arena's
cache of free blocks (``TORCH_MP_EXT_ARENA_CACHE_BYTES``) bounds what items of changing sizes
leave behind. How every process stops: Note [Stopping a pipeline] in ``pipeline/run.py``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import multiprocessing
import os
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple

from ..errors import PipelineError, QueueClosedError
from ..processes.spawn import launch_plan
from ..sharing import byvalue
from .links import Stop, Upstream
from .run import Group, Running, launch, shutdown

__all__ = ["pipeline", "stage", "Pipeline", "Stage", "SHUTDOWN_GRACE_S"]

log = logging.getLogger("torch_mp_ext.pipeline")

SHUTDOWN_GRACE_S = float(os.environ.get("TORCH_MP_EXT_PIPELINE_GRACE_S", 5.0))
"""Seconds a shutdown waits for stages to stop by themselves before terminating them.

Example:
    ```python
    from torch_mp_ext.pipeline import SHUTDOWN_GRACE_S

    assert SHUTDOWN_GRACE_S > 0   # TORCH_MP_EXT_PIPELINE_GRACE_S changes it
    ```
"""


def _name(fn: Any) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class _Spec:
    """One stage as given: its function, ``"stream"`` or ``"each"``, its own buffer_size."""

    def __init__(self, fn: Callable[..., Any], position: int,
                 buffer_size: Optional[int] = None) -> None:
        if not callable(fn):
            raise TypeError(f"stage {position} must be a generator function or a function of "
                            f"one item, got {type(fn).__qualname__}")
        self.fn = fn
        self.kind = ("stream" if isinstance(fn, Stage) or inspect.isgeneratorfunction(fn)
                     else "each")
        self.name = _name(fn)
        self.buffer_size = fn.buffer_size if isinstance(fn, Stage) else buffer_size


class Pipeline(Iterator[Any]):
    """An iterator over the results of stages running in processes (see :func:`pipeline`).

    Processes start at the first ``next()``. Iterate it once; ``close()`` (or ``with``, or
    dropping it) stops every process early.

    Example:
        ```python
        import torch_mp_ext as mp

        def double(items):
            for x in items:
                yield 2 * x

        if __name__ == "__main__":
            with mp.pipeline(range(100), double, start_method="fork") as results:
                first = next(results)   # the processes start here
            assert first == 0   # leaving the block stopped every process early
        ```
    """

    def __init__(self, source: Any, specs: List[_Spec], buffer_size: int = 3, workers: int = 1,
                 ordered: bool = True, start_method: Optional[str] = None) -> None:
        self._source = source
        self._specs = specs
        self._buffer_size = _positive("buffer_size", buffer_size)
        self._workers = _positive("workers", workers)
        self._ordered = bool(ordered)
        methods = multiprocessing.get_all_start_methods()
        if start_method is not None and start_method not in methods:
            raise ValueError(f"start_method must be None or one of {methods}, got "
                             f"{start_method!r}")
        self._start_method = start_method
        self._state: Optional[Running] = None
        self._absorbed = False
        self._closed = False

    def __repr__(self) -> str:
        stages = ", ".join(s.name for s in self._specs)
        state = ("closed" if self._closed else "running" if self._state else "not started")
        return f"<torch_mp_ext.Pipeline [{stages}] {state}>"

    def __iter__(self) -> Pipeline:
        return self

    def __next__(self) -> Any:
        state = self._state
        if state is None:
            if self._closed:
                raise StopIteration
            state = self._start()
        if state.closed:
            raise StopIteration
        try:
            return next(state.inlet)  # type: ignore[arg-type]
        except Upstream as up:
            err = up.failure.error()
            killed = self._killed_stage(state, isinstance(err.__cause__, OSError))
            self.close()
            if killed is not None:  # the cause: what the stage raised was its effect
                raise killed from err
            raise err from err.__cause__
        except (Stop, QueueClosedError):
            if not state.closed:
                self.close()
                raise
            raise StopIteration from None  # closed by another thread meanwhile
        except BaseException:  # the end (StopIteration), a dead stage, Ctrl-C
            self.close()
            raise

    @staticmethod
    def _killed_stage(state: Running, wait: bool) -> Optional[PipelineError]:
        """The error for a stage killed by a signal, if one was: a stage that raised because
        a peer died under it (an OSError: an fd it could no longer fetch from the dead one) is
        not the one to name. ``wait``: give the death 0.2 s to be reported (a forkserver
        reports its children's exits asynchronously)."""
        deadline = time.monotonic() + (0.2 if wait else 0.0)
        while True:
            try:
                state.check()
            except PipelineError as died:
                if died.signal_name is not None:
                    return died
            except Stop:
                return None
            if time.monotonic() >= deadline:
                return None
            # Justified sleep: at most 0.2 s, once, on the error path; the forkserver's exit
            # report has no event of ours to wait on.
            time.sleep(0.01)

    def close(self) -> None:
        """Stops every stage and joins their processes; later ``next()`` ends the iteration."""
        self._closed = True
        if self._state is not None:
            self._finalizer()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def pids(self) -> Tuple[int, ...]:
        """The stage processes' pids (empty before the first ``next()``)."""
        return self._state.pids if self._state is not None else ()

    def _then(self, spec: _Spec, start_method: Optional[str]) -> Pipeline:
        if (start_method and self._start_method and start_method != self._start_method):
            raise ValueError(f"stage {spec.name!r} wants start_method={start_method!r} but "
                             f"the stages before it use {self._start_method!r}")
        self._absorbed = True
        return Pipeline(self._source, self._specs + [spec], self._buffer_size, self._workers,
                        self._ordered, start_method or self._start_method)

    # -- starting --------------------------------------------------------------------------
    def _start(self) -> Running:
        if self._absorbed:
            raise RuntimeError(f"{self!r} was passed to another stage, which iterates it: "
                               "iterate the outermost call's result instead")
        method = self._start_method or multiprocessing.get_start_method()
        ctx, _, parent = launch_plan(method)
        state = Running()
        self._state = state
        self._finalizer = weakref.finalize(self, shutdown, state, SHUTDOWN_GRACE_S)
        try:
            launch(state, self._groups(), self._ordered, ctx, parent)
        except BaseException:
            self.close()
            raise
        log.debug("started %r: pids %s", self, self.pids)
        return state

    def _groups(self) -> List[Group]:
        """(kind, fn, name, processes, buffer_size) for the source, each stage, the consumer."""
        source = self._source
        local = not callable(source) or hasattr(source, "__iter__")
        name = type(source).__qualname__ if local else _name(source)
        groups = [("local" if local else "source", source, name, 1, self._buffer_size)]
        for spec in self._specs:
            count = self._workers if spec.kind == "each" else 1
            groups.append((spec.kind, spec.fn, spec.name, count,
                           spec.buffer_size or self._buffer_size))
        groups.append(("consumer", None, "consumer", 1, 0))
        return groups


def pipeline(source: Any, *stages: Callable[..., Any], buffer_size: int = 3, workers: int = 1,
             ordered: bool = True, start_method: Optional[str] = None) -> Pipeline:
    """Runs ``stages`` over ``source``'s items in processes; returns an iterator of results.

    Args:
        source: an iterable (iterated by a thread of this process), or a function returning
            one, typically a generator function (run in a process of its own).
        *stages: each a generator function ``stage(items)`` yielding results (one process),
            or a function ``stage(item)`` returning one result (``workers`` processes).
        buffer_size: most items each queue between two stages holds.
        workers: processes for each per-item stage.
        ordered: keep the source's order through per-item stages with several workers (a
            slow item holds back those behind it); False yields results as they are ready.
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"`` (torch_mp_ext's fast
            server); None: the default context's. Under spawn and forkserver the stages are
            pickled, so define them at the top level of a module.

    Returns:
        A :class:`Pipeline`; its processes start at the first ``next()``.

    Raises:
        ValueError: ``buffer_size`` or ``workers`` not a positive integer, or an unknown
            ``start_method``.
        TypeError: a stage is not callable, or ``source`` neither iterable nor callable.

    Iterating raises :class:`~torch_mp_ext.errors.PipelineError` when a stage raises (its
    exception, with its traceback, is the ``__cause__``) or its process dies, after every
    stage was stopped.

    Example:
        ```python
        import numpy as np
        import torch_mp_ext as mp

        def frames():
            for i in range(8):
                yield np.full((256, 256), i, np.float32)

        def square(items):
            for x in items:
                yield x * x

        if __name__ == "__main__":
            total = sum(a[0, 0] for a in mp.pipeline(frames, square, start_method="fork"))
            assert total == sum(i * i for i in range(8))
        ```
    """
    if not (callable(source) or hasattr(source, "__iter__")):
        raise TypeError(f"source must be an iterable or a function returning one, got "
                        f"{type(source).__qualname__}")
    specs = [_Spec(fn, position) for position, fn in enumerate(stages, 1)]
    return Pipeline(source, specs, buffer_size, workers, ordered, start_method)


class Stage:
    """A generator function made a pipeline stage by :func:`stage` (see there).

    Example:
        ```python
        import torch_mp_ext as mp

        @mp.stage(2, start_method="fork")
        def plus_one(items):
            for x in items:
                yield x + 1

        if __name__ == "__main__":
            assert isinstance(plus_one, mp.Stage)
            assert list(plus_one(range(3))) == [1, 2, 3]
        ```
    """

    def __init__(self, fn: Callable[[Iterable[Any]], Iterable[Any]], buffer_size: int,
                 start_method: Optional[str]) -> None:
        functools.update_wrapper(self, fn)
        self.__wrapped_stage__ = fn
        self._module: str = fn.__module__
        self._qualname: str = _name(fn)
        self.buffer_size = _positive("buffer_size", buffer_size)
        self.start_method = start_method

    def __call__(self, items: Any) -> Pipeline:
        """``items`` in, a :class:`Pipeline` of this stage's results out.

        ``items`` may be another stage's result (not iterated yet: the two become one
        pipeline), any iterable (iterated by a thread of this process), or a function
        returning an iterable, such as a generator function (run in a process of its own).
        """
        spec = _Spec(self, 1)
        if isinstance(items, Pipeline) and items._state is None and not items._absorbed:
            return items._then(spec, self.start_method)
        if not (callable(items) or hasattr(items, "__iter__")):
            raise TypeError(f"{self._qualname}() takes an iterable or a function returning "
                            f"one, got {type(items).__qualname__}")
        return Pipeline(items, [spec], self.buffer_size, start_method=self.start_method)

    def __repr__(self) -> str:
        return f"<torch_mp_ext.Stage {self._qualname} buffer_size={self.buffer_size}>"

    def __reduce__(self) -> Any:
        # By reference, as functions are: the module attribute is this object, not its
        # function. A local stage, or one of a __main__ that children cannot import, travels
        # as its function, which plain pickling refuses and the by-value fallback takes
        # (Note [By-value fallback] in sharing/byvalue.py).
        found: Any = _find_stage(self._module, self._qualname, check=False)
        if found is not self or (self._module == "__main__"
                                 and not byvalue.main_is_importable()):
            return (Stage, (self.__wrapped_stage__, self.buffer_size, self.start_method))
        return (_find_stage, (self._module, self._qualname))


def _find_stage(module: str, qualname: str, check: bool = True) -> Any:
    import importlib

    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        if check:
            raise
        return None
    return obj


def stage(buffer_size: Any = 3, *, start_method: Optional[str] = None) -> Any:
    """Decorates a generator function ``f(items)`` so that each call runs it in a process.

    ``f(g(h(xs())))`` becomes one pipeline: h, g and f each in a process of their own, joined
    by queues holding at most ``buffer_size`` of each stage's results, iterated by the
    caller. This API started from the ``parallel_pipeline`` decorator of a Stack Overflow
    answer; unlike it, the results are not pickled (arrays and tensors cross as handles), a
    failure reaches the caller, stopping early stops every process, and it works under every
    start method.

    Args:
        buffer_size: most results of this stage queued for the next (positive integer).
        start_method: as for :func:`pipeline`.

    Returns:
        A decorator making :class:`Stage` objects (``@stage`` without parentheses also works).

    Example:
        ```python
        import torch_mp_ext as mp

        @mp.stage(start_method="fork")
        def h(items):
            for x in items:
                yield x * x

        @mp.stage(start_method="fork")
        def g(items):
            for x in items:
                yield x + 1

        if __name__ == "__main__":
            assert list(g(h(range(4)))) == [1, 2, 5, 10]   # h and g in processes of their own
        ```
    """
    if callable(buffer_size):
        return Stage(buffer_size, 3, start_method)
    _positive("buffer_size", buffer_size)
    return lambda fn: Stage(fn, buffer_size, start_method)
