"""What a pipeline stage's process runs, and the thread that feeds a local source.

Note [Stage process lifecycle]
Each process has a status byte in the pipeline's control block (an arena array of uint8:
``control[0]`` is the pipeline's phase, ``control[slot]`` this process's status)::

    NEW ──▶ RUNNING ──▶ FINISHED   its items and END were put
                    ├─▶ REPORTED   a failure (its own or forwarded from upstream) was put
                    └─▶ STOPPED    the consumer asked the pipeline to stop (phase STOPPING)

and then it waits for phase EXIT before it returns. The consumer sets STOPPING when it stops
early, fails, or has read the END (every item was received), waits for every status to be
final, discards what is left in the queues (the owners of the blocks those items name are
still alive to take them back), then sets EXIT. Nobody polls the bytes: a process that sets
a final status also puts its slot on the pipeline's ``events`` queue, which the consumer's
wait reads, and the consumer puts one token per process on the ``exits`` queue with EXIT,
which the finished processes wait on (a ring wait: no CPU while the consumer is busy). So no
process exits while a handle to its memory is in flight: nothing needs an exit keeper,
nothing is left behind. A process that
exits before EXIT died; the consumer notices while waiting for items and reports it.
Stage processes ignore SIGINT: Ctrl-C reaches the consumer, which stops them all in order.

Note [Stage processes freeze the heap they start with]
A stage process starts with every object its parent had (fork) or its imports made (torch
alone is hundreds of thousands); the garbage collector walks them all in each full
collection, which stages trigger as they allocate per item: 7% of a stage's time on the
Stack Overflow workload. ``gc.freeze()`` moves them out of its sight (CPython's advice for
pre-fork servers); objects made by the stage are collected as usual.

Note [Stage arrays are handed over]
A stage process allocates its numpy arrays of 64 KiB or more in arena blocks (Note [Arrays
born shared] in ``csrc/shm/block_allocator.h``), so what it yields crosses to the next stage
without a copy, as an item crosses a thread pipeline by reference: the next stage sees the
memory the array had when it was yielded *and after*. Stages must not modify an array after
yielding it. ``TORCH_MP_EXT_PIPELINE_SHARE_NUMPY=0`` turns this off (arrays are then copied
once when sent, as by ``Queue.put``).
"""

from __future__ import annotations

import gc
import os
import queue
import signal
from typing import Any, Callable, Iterable, Optional

import numpy as np

from ..processes.worker import die_with_parent
from ..processes.worker_reports import enable_fault_file
from ..sharing.memory import numpy_in_blocks
from .links import Failure, Inlet, Outlet, Role, Stop, Upstream

__all__ = ["NEW", "RUNNING", "FINISHED", "REPORTED", "STOPPED", "STOPPING", "EXIT", "Task",
           "run", "feed"]

# Statuses (control[slot]) and phases (control[0]): Note [Stage process lifecycle].
NEW, RUNNING, FINISHED, REPORTED, STOPPED = 0, 1, 2, 3, 4
STOPPING, EXIT = 1, 2
#: A finished process re-reads the phase this often while it waits for EXIT (it is woken by
#: its token on ``exits`` at once; this only bounds a lost token's cost).
_EXIT_WAIT_S = 30.0
_SHARE_NUMPY = os.environ.get("TORCH_MP_EXT_PIPELINE_SHARE_NUMPY", "1") != "0"


class Task:
    """Everything one stage process needs; pickled to it under spawn and forkserver.

    Args:
        role: which stage and worker it is.
        kind: ``"source"`` (``fn()`` yields items), ``"stream"`` (``fn(items)`` yields
            results) or ``"each"`` (``fn(item)`` returns a result).
        fn: the user's function.
        inputs: ``(queues, ends)`` for its :class:`Inlet`; None for a source.
        outputs: ``(queues, end_copies)`` for its :class:`Outlet`.
        control: the control block.
        slot: its index in ``control``.
        parent: how it watches its parent (``_worker.die_with_parent``).
        signals: the pipeline's ``(events, exits)`` queues (Note [Stage process lifecycle]).
        index: ``(first, step)`` of the stream positions of the items it receives, when
            known (ordered per-item stages), for error messages.
        fault_dir: where a native crash's stack goes (``processes.worker_reports``).
    """

    def __init__(self, role: Role, kind: str, fn: Callable[..., Any], inputs: Any,
                 outputs: Any, control: np.ndarray, slot: int, parent: tuple,
                 signals: tuple, index: Optional[tuple] = None,
                 fault_dir: Optional[str] = None) -> None:
        self.role, self.kind, self.fn = role, kind, fn
        self.inputs, self.outputs = inputs, outputs
        self.control, self.slot, self.parent, self.index = control, slot, parent, index
        self.signals = signals
        self.fault_dir = fault_dir


def _items(n: int) -> str:
    return f"{n} item" if n == 1 else f"{n} items"


def _detail(task: Task, inlet: Optional[Inlet], produced: int) -> str:
    if task.kind == "source":
        return f", after yielding {_items(produced)}"
    received = inlet.count if inlet is not None else 0
    if task.kind == "each" and task.index is not None and received:
        first, step = task.index
        return f", on item {first + step * (received - 1)} of the stream (counting from 0)"
    return f", after receiving {_items(received)}"


def _serve(task: Task, inlet: Optional[Inlet], outlet: Outlet) -> int:
    """Runs the stage until its input ends, it fails or it is stopped; returns its status."""
    fn = getattr(task.fn, "__wrapped_stage__", task.fn)  # a @stage's function, not its wrapper
    it: Any = None
    try:
        if task.kind == "each" and inlet is not None:
            while True:
                outlet.reserve()  # Note [Produce into room]
                try:
                    x = next(inlet)
                except StopIteration:
                    break
                y = fn(x)
                del x  # hold the input no longer than needed (Note [Pipeline memory])
                outlet.put(y)
                del y
        else:
            it = iter(fn() if task.kind == "source" else fn(inlet))
            while True:
                outlet.reserve()
                try:
                    y = next(it)
                except StopIteration:
                    break
                outlet.put(y)
                del y
        outlet.end()
        return FINISHED
    except Stop:
        return STOPPED
    except Upstream as up:
        return _report(outlet, up.failure)
    except BaseException as exc:  # noqa: BLE001 (any failure of user code goes downstream)
        failure = Failure.capture(exc, task.role, os.getpid(), _detail(task, inlet, outlet.count))
        del exc
        return _report(outlet, failure)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            try:
                close()
            except BaseException:  # noqa: BLE001 (the stage already ended)
                pass


def _report(outlet: Outlet, failure: Failure) -> int:
    try:
        outlet.fail(failure)
    except Stop:
        return STOPPED
    return REPORTED


def run(task: Task) -> None:
    """A stage process's entry point (Note [Stage process lifecycle])."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(task.parent)
    if task.fault_dir is not None:
        enable_fault_file(task.fault_dir)
    gc.freeze()  # Note [Stage processes freeze the heap they start with]
    if _SHARE_NUMPY:
        numpy_in_blocks(True)  # Note [Stage arrays are handed over]
    control = task.control

    def idle() -> None:
        if control[0]:
            raise Stop

    control[task.slot] = RUNNING
    inlet = Inlet(task.inputs[0], task.inputs[1], idle) if task.inputs is not None else None
    outlet = Outlet(task.outputs[0], task.outputs[1], idle)
    status = _serve(task, inlet, outlet)
    del inlet, outlet
    control[task.slot] = status
    events, exits = task.signals
    events.put(task.slot)  # Note [Stage process lifecycle]: the consumer's wait wakes
    while control[0] != EXIT:
        try:
            exits.get(True, _EXIT_WAIT_S)
        except queue.Empty:
            continue


def feed(source: Iterable[Any], role: Role, outlet: Outlet) -> None:
    """Puts a local source's items on the first link, from a thread of the consumer's process
    (its ``idle`` raises :class:`Stop` once the pipeline stops)."""
    if _SHARE_NUMPY:
        numpy_in_blocks(True)  # this thread only: Note [Stage arrays are handed over]
    produced = 0
    try:
        it = iter(source)
        while True:
            outlet.reserve()
            try:
                y = next(it)
            except StopIteration:
                break
            outlet.put(y)
            produced += 1
            del y
        outlet.end()
    except Stop:
        return
    except BaseException as exc:  # noqa: BLE001 (the source's failure goes downstream)
        failure = Failure.capture(exc, role, os.getpid(), f", after yielding {_items(produced)}")
        del exc
        try:
            outlet.fail(failure)
        except BaseException:  # noqa: BLE001 (stopping, or the queue was closed meanwhile)
            return
