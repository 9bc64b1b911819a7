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
[Produce into room] in ``_pipeline_links.py``). A generator stage, like a consumer's ``for``
loop, briefly holds two inputs (its loop variable keeps the last while the next arrives). So
with one worker per stage about ``(stages + 1) * (buffer_size + 1)`` items, and at most
``(stages + 1) * (buffer_size + 2)``, exist at once however long the stream (measured in
tests/test_pipeline.py): a block freed by its receiver returns to its owner's
pool and becomes that owner's next item. Workers multiply their stage's share; the arena's
cache of free blocks (``TORCH_MP_EXT_ARENA_CACHE_BYTES``) bounds what items of changing sizes
leave behind.

Note [Stopping a pipeline]
Iteration ending, ``close()``, ``with``, garbage collection, interpreter exit, a stage's
failure and Ctrl-C all end in one shutdown (Note [Stage process lifecycle] in
``_pipeline_stage.py``): every process stops at its next item, what is left in the queues is
discarded with the block references it holds, and the processes are joined. A process still
busy after ``SHUTDOWN_GRACE_S`` (a stage stuck in its own code) is terminated, then killed.
"""

from __future__ import annotations

import functools
import inspect
import logging
import multiprocessing
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from . import _exits
from ._pipeline_links import Inlet, Outlet, Role, Stop, Upstream, discard
from ._pipeline_stage import EXIT, FINISHED, NEW, REPORTED, STOPPING, Task, feed, run
from .arena import zeros_array
from .errors import PipelineError, QueueClosedError
from .queues import Queue
from .spawn import _launch_plan

__all__ = ["pipeline", "stage", "Pipeline", "Stage", "SHUTDOWN_GRACE_S"]

log = logging.getLogger(__name__)

#: Seconds a shutdown waits for stages to stop by themselves before terminating them.
SHUTDOWN_GRACE_S = float(os.environ.get("TORCH_MP_EXT_PIPELINE_GRACE_S", 5.0))


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


class _Running:
    """A started pipeline's processes, queues and control block; what shutdown needs (it
    holds no reference to the :class:`Pipeline`, so the pipeline can be collected)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.processes: List[Tuple[Any, Role, int]] = []
        self.pids: Tuple[int, ...] = ()
        self.queues: List[Queue] = []
        self.control: Any = None
        self.thread: Optional[threading.Thread] = None
        self.inlet: Optional[Inlet] = None
        self.oom_before = _exits.oom_kill_counts()
        self.closed = False

    def check(self) -> None:
        """The consumer's idle check: raises for a stage process that died."""
        if self.closed:  # by close() from another thread
            raise Stop
        for process, role, slot in self.processes:
            code = process.exitcode
            if code is None or self.control[slot] == REPORTED:
                continue
            reason, explanation = _exits.explain_exit(code, oom_before=self.oom_before)
            if code == 0 or (self.control[slot] == NEW and code > 0):
                explanation = (
                    "It exited before the end of its stream. "
                    + ("It never started: its function or the pipeline's queues could not be "
                       "unpickled there (see its stderr; define stage functions at the top "
                       "level of a module)." if self.control[slot] == NEW else
                       "Did it call os._exit()?"))
            message = f"{role.describe(process.pid)} {_exits.summarize(reason, code)}"
            raise PipelineError(
                message + (f". {explanation}" if explanation else ""), stage=role.name,
                position=role.position, worker=role.worker, pid=process.pid, exit_code=code,
                signal_name=_exits.signal_name(-code) if code < 0 else None)

    def stopping(self) -> None:
        if self.control[0]:
            raise Stop


def _shutdown(state: _Running, grace: float) -> None:
    """Stops and joins everything (Note [Stopping a pipeline]); safe to call twice."""
    if state.closed or os.getpid() != state.pid:  # a forked child's copy owns nothing
        return
    state.closed = True
    control = state.control
    if control is not None:
        control[0] = STOPPING
    deadline = time.monotonic() + grace
    while control is not None and time.monotonic() < deadline and any(
            p.exitcode is None and control[slot] < FINISHED for p, _, slot in state.processes):
        time.sleep(0.002)
    if state.thread is not None and state.thread.ident is not None:
        state.thread.join(max(deadline - time.monotonic(), 0.0))
        if state.thread.is_alive():
            log.warning("a pipeline's source iterator has not returned within %.1f s of the "
                        "shutdown; its thread stops at its next item", grace)
    discard(state.queues)
    if control is not None:
        control[0] = EXIT
    for process, role, _ in state.processes:
        process.join(max(deadline - time.monotonic(), 0.0) + 1.0)
        if process.exitcode is None:
            log.warning("%s did not stop within %.1f s; terminating it",
                        role.describe(process.pid), grace)
            process.terminate()
            process.join(1.0)
            if process.exitcode is None:
                process.kill()
                process.join()
        process.close()  # its sentinel fd
    for q in state.queues:
        q.close()  # the last holder drops what is left (Note [Queue lifetime])
    state.inlet = None
    state.control = None


class Pipeline(Iterator[Any]):
    """An iterator over the results of stages running in processes (see :func:`pipeline`).

    Processes start at the first ``next()``. Iterate it once; ``close()`` (or ``with``, or
    dropping it) stops every process early.
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
        self._state: Optional[_Running] = None
        self._absorbed = False
        self._closed = False

    def __repr__(self) -> str:
        stages = ", ".join(s.name for s in self._specs)
        state = ("closed" if self._closed else "running" if self._state else "not started")
        return f"<torch_mp_ext.Pipeline [{stages}] {state}>"

    def __iter__(self) -> "Pipeline":
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
            self.close()
            err = up.failure.error()
            raise err from err.__cause__
        except (Stop, QueueClosedError):
            if not state.closed:
                self.close()
                raise
            raise StopIteration from None  # closed by another thread meanwhile
        except BaseException:  # the end (StopIteration), a dead stage, Ctrl-C
            self.close()
            raise

    def close(self) -> None:
        """Stops every stage and joins their processes; later ``next()`` ends the iteration."""
        self._closed = True
        if self._state is not None:
            self._finalizer()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def pids(self) -> Tuple[int, ...]:
        """The stage processes' pids (empty before the first ``next()``)."""
        return self._state.pids if self._state is not None else ()

    def _then(self, spec: _Spec, start_method: Optional[str]) -> "Pipeline":
        if (start_method and self._start_method and start_method != self._start_method):
            raise ValueError(f"stage {spec.name!r} wants start_method={start_method!r} but "
                             f"the stages before it use {self._start_method!r}")
        self._absorbed = True
        return Pipeline(self._source, self._specs + [spec], self._buffer_size, self._workers,
                        self._ordered, start_method or self._start_method)

    # -- starting --------------------------------------------------------------------------
    def _start(self) -> _Running:
        if self._absorbed:
            raise RuntimeError(f"{self!r} was passed to another stage, which iterates it: "
                               "iterate the outermost call's result instead")
        method = self._start_method or multiprocessing.get_start_method()
        ctx, _, parent = _launch_plan(method)
        state = _Running()
        self._state = state
        self._finalizer = weakref.finalize(self, _shutdown, state, SHUTDOWN_GRACE_S)
        try:
            self._launch(state, ctx, parent)
        except BaseException:
            self.close()
            raise
        log.debug("started %r: pids %s", self, self.pids)
        return state

    def _groups(self) -> List[Tuple[str, Any, str, int, int]]:
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

    def _launch(self, state: _Running, ctx: Any, parent: tuple) -> None:
        groups = self._groups()
        nprocs = sum(g[3] for g in groups if g[0] not in ("local", "consumer"))
        state.control = control = zeros_array(1 + nprocs, np.uint8)
        # Note [Pipeline links]: for each link, each producer's (targets, end_copies) and
        # each consumer's (sources, ends).
        writers: List[List[tuple]] = []
        readers: List[List[tuple]] = []
        for (_, _, _, n_p, size), (_, _, _, n_c, _) in zip(groups, groups[1:]):
            lanes = n_p == n_c or self._ordered
            qs = [Queue(size) for _ in range(max(n_p, n_c) if lanes else 1)]
            state.queues += qs
            if n_p == n_c:
                writers.append([([q], 1) for q in qs])
                readers.append([([q], 1) for q in qs])
            elif n_p == 1:
                writers.append([(qs, 1 if lanes else n_c)])
                readers.append([([q], 1) for q in qs] if lanes else [(qs, 1)] * n_c)
            else:
                writers.append([([q], 1) for q in qs] if lanes else [(qs, 1)] * n_p)
                readers.append([(qs, 1 if lanes else n_p)])
        slot = 0
        for position, (kind, fn, name, count, _) in enumerate(groups[:-1]):
            if kind == "local":
                role = Role(name, 0, local=True)
                outlet = Outlet(*writers[0][0], state.stopping)
                state.thread = threading.Thread(target=feed, args=(fn, role, outlet),
                                                name="torch_mp_ext-pipeline-source",
                                                daemon=True)
                continue
            for worker in range(count):
                slot += 1
                role = Role(name, position, worker, count)
                index = (worker, count) if self._ordered or count == 1 else None
                task = Task(role, kind, fn, readers[position - 1][worker] if position else None,
                            writers[position][worker], control, slot, parent, index)
                process = ctx.Process(target=run, args=(task,), daemon=False,
                                      name=f"torch_mp_ext-pipeline-{position}-{worker}")
                try:
                    process.start()
                except Exception as exc:
                    raise type(exc)(
                        f"could not start {role.describe(None)} with start method "
                        f"{ctx.get_start_method()!r}: {exc}. Under spawn and forkserver a "
                        "stage is pickled: define it (and its arguments) at the top level "
                        "of a module, or use start_method='fork'") from exc
                state.processes.append((process, role, slot))
                state.pids += (process.pid,)
        state.inlet = Inlet(*readers[-1][0], state.check)
        if state.thread is not None:
            state.thread.start()  # after every fork: a forked child copies no running thread


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
    """
    if not (callable(source) or hasattr(source, "__iter__")):
        raise TypeError(f"source must be an iterable or a function returning one, got "
                        f"{type(source).__qualname__}")
    specs = [_Spec(fn, position) for position, fn in enumerate(stages, 1)]
    return Pipeline(source, specs, buffer_size, workers, ordered, start_method)


class Stage:
    """A generator function made a pipeline stage by :func:`stage` (see there)."""

    def __init__(self, fn: Callable[[Iterable[Any]], Iterable[Any]], buffer_size: int,
                 start_method: Optional[str]) -> None:
        functools.update_wrapper(self, fn)
        self.__wrapped_stage__ = fn
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
            raise TypeError(f"{self.__qualname__}() takes an iterable or a function returning "
                            f"one, got {type(items).__qualname__}")
        return Pipeline(items, [spec], self.buffer_size, start_method=self.start_method)

    def __repr__(self) -> str:
        return f"<torch_mp_ext.Stage {self.__qualname__} buffer_size={self.buffer_size}>"

    def __reduce__(self) -> Any:
        # By reference, as functions are: the module attribute is this object, not its function.
        found: Any = _find_stage(self.__module__, self.__qualname__, check=False)
        if found is not self:
            import pickle

            raise pickle.PicklingError(
                f"stage {self.__qualname__!r} cannot be sent to a spawn or forkserver process: "
                f"it is not the top-level name {self.__module__}.{self.__qualname__}; define "
                "it at the top level of a module, or use start_method='fork'")
        return (_find_stage, (self.__module__, self.__qualname__))


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
    caller. The seed of this API is the ``parallel_pipeline`` decorator of a Stack Overflow
    answer; unlike it, the results are not pickled (arrays and tensors cross as handles), a
    failure reaches the caller, stopping early stops every process, and it works under every
    start method.

    Args:
        buffer_size: most results of this stage queued for the next (positive integer).
        start_method: as for :func:`pipeline`.

    Returns:
        A decorator making :class:`Stage` objects (``@stage`` without parentheses also works).
    """
    if callable(buffer_size):
        return Stage(buffer_size, 3, start_method)
    _positive("buffer_size", buffer_size)
    return lambda fn: Stage(fn, buffer_size, start_method)
