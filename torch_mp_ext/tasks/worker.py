"""What a :class:`~torch_mp_ext.TaskPool` worker runs: one task at a time, values as they come.

Messages (tuples on two crash-safe queues, Note [Task protocol] in ``tasks/pool.py``)::

    owner -> worker (its own queue)                 worker -> owner (one queue for all)
    (TASK, tid, payload, mode, k, max_buffered,      (ITEM, wid, tid, index, wire)
           skip, consumed)                           (DONE, wid, tid, produced, error, flag)
    (CREDIT, tid, consumed)                          (WAIT, wid, tid)
    (CANCEL, tid)                                    (READY, wid, pid)
    (STOP,)                                          (INIT_FAILED, wid, error)
                                                     (DIED, wid), (WAKE, -1): from the pool
                                                     itself (Note [Who reads the result
                                                     queue] in ``tasks/pump.py``)

Note [One value at a time]
A value is pickled as soon as it is yielded: tensors and arrays go to the arena (moved in
place, or copied once for ordinary numpy arrays), the worker drops its own reference, and
only then asks the generator for the next one. So a generator of large arrays holds at most
the one it is making, plus the arena copy of the last until the caller's side has it.
With a fixed ``num_returns=k`` the k-th value's *pickle* waits until the generator has
finished (only then is it known that it does not yield more), which costs no memory beyond
the arena copy that had to exist anyway.
"""

from __future__ import annotations

import inspect
import os
from collections import deque
from typing import Any, Callable

from ..errors import ReturnCountError
from ..processes.worker import die_with_parent
from ..processes.worker_reports import enable_fault_file
from .refs import Ref
from .values import Value, discard, encode, encode_error

__all__ = ["main"]

TASK, CREDIT, CANCEL, STOP = range(4)
ITEM, DONE, WAIT, READY, INIT_FAILED, DIED, WAKE = range(7)
MODE_ONE, MODE_FIXED, MODE_DYNAMIC, MODE_STREAMING = range(4)
FLAG_OK, FLAG_CANCELLED = 0, 1


def main(wid: int, tasks: Any, results: Any, initializer: Callable[..., Any] | None,
         initargs: tuple, parent: tuple[str, int | None] = ("pdeathsig", None),
         fault_dir: str | None = None) -> None:
    """The worker process's target; ``parent`` says how it dies with the pool's process
    (Note [Children die with their parent] in ``processes/worker.py``); a native crash's
    stack goes to a file in ``fault_dir``, for the pool's ``WorkerDiedError``."""
    die_with_parent(parent)
    if fault_dir is not None:
        enable_fault_file(fault_dir)
    if initializer is not None:
        try:
            initializer(*initargs)
        except Exception as e:  # noqa: BLE001 (reported to the pool, which stops)
            results.put((INIT_FAILED, wid, encode_error(e)))
            return
    results.put((READY, wid, os.getpid()))
    _Worker(wid, tasks, results).loop()


def label(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class _Worker:
    def __init__(self, wid: int, tasks: Any, results: Any) -> None:
        self.wid = wid
        self.tasks = tasks
        self.results = results
        self.stash: deque = deque()  # messages read while a task ran, not for it

    def loop(self) -> None:
        while True:
            msg = self.stash.popleft() if self.stash else self.tasks.get()
            if msg[0] == STOP:
                return
            if msg[0] == TASK:
                self.run(*msg[1:])
            # CREDIT / CANCEL of a task that already ended: nothing to do.

    # -- messages --------------------------------------------------------------------------
    def item(self, tid: int, index: int, wire: Any) -> None:
        self.results.put((ITEM, self.wid, tid, index, wire))

    def done(self, tid: int, produced: int, error: Any = None, flag: int = FLAG_OK) -> None:
        self.results.put((DONE, self.wid, tid, produced, error, flag))

    def control(self, tid: int, block: bool) -> Any:
        """The next CREDIT (its count) or CANCEL (None) for task ``tid``; False if there is
        none and ``block`` is false. Other messages wait in ``stash``."""
        while block or not self.tasks.empty():
            msg = self.tasks.get()
            if msg[0] in (TASK, STOP):
                self.stash.append(msg)
            elif msg[1] == tid:
                return msg[2] if msg[0] == CREDIT else None
        return False

    # -- running a task --------------------------------------------------------------------
    def run(self, tid: int, payload: Any, mode: int, k: int, max_buffered: int,
            skip: int, consumed: int) -> None:
        try:
            fn, args, kwargs = Value.from_wire(payload).load()
            args = [a.get() if type(a) is Ref else a for a in args]
            kwargs = {n: a.get() if type(a) is Ref else a for n, a in kwargs.items()}
            result = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (the task's error goes into its refs)
            self.done(tid, 0, encode_error(e))
            return
        if mode == MODE_ONE:
            if inspect.isgenerator(result):
                self.done(tid, 0, encode_error(TypeError(
                    f"{label(fn)} returned a generator, but was submitted with num_returns=1: "
                    "submit it with num_returns=k (k values), 'dynamic' or 'streaming'")))
                return
            try:
                wire = encode(result)
            except Exception as e:  # noqa: BLE001
                self.done(tid, 0, encode_error(e))
                return
            del result
            self.results.put_many([(ITEM, self.wid, tid, 0, wire),
                                   (DONE, self.wid, tid, 1, None, FLAG_OK)])
        elif mode == MODE_FIXED:
            self.run_fixed(tid, label(fn), result, k, skip)
        else:
            self.run_stream(tid, result, mode == MODE_STREAMING, max_buffered, skip, consumed)

    def run_fixed(self, tid: int, label: str, result: Any, k: int, skip: int) -> None:
        if not hasattr(result, "__next__"):  # a plain function returning k values
            if isinstance(result, (list, tuple)) and len(result) == k:
                for i, value in enumerate(result):
                    if i >= skip:
                        self.item(tid, i, encode(value))
                self.done(tid, k)
                return
            what = (f"a {type(result).__name__} of {len(result)} values"
                    if isinstance(result, (list, tuple)) else f"a {type(result).__name__}")
            self.done(tid, 0, encode_error(ReturnCountError(
                f"{label} was submitted with num_returns={k} but returned {what}: return a "
                f"list or tuple of {k} values, or yield {k} values",
                k, len(result) if isinstance(result, (list, tuple)) else 1)))
            return
        produced = 0
        held = None  # the k-th value's wire, sent once the generator has ended
        try:
            while True:
                try:
                    value = next(result)
                except StopIteration:
                    break
                if produced == k:  # one too many: stop it (Ray only logs this, #28689)
                    del value
                    _close(result)
                    if held is not None:
                        discard(held)
                    self.done(tid, k - 1, encode_error(ReturnCountError(
                        f"{label} yielded more than num_returns={k} values: it was stopped at "
                        f"its value {k + 1}, and this ref holds this error instead of its "
                        f"value {k}; submit it with num_returns={k + 1} or more, or "
                        f"'dynamic' or 'streaming'", k, k + 1)))
                    return
                wire = encode(value)
                del value  # Note [One value at a time]
                if produced == k - 1:
                    held = wire
                elif produced >= skip:
                    self.item(tid, produced, wire)
                else:
                    discard(wire)
                produced += 1
        except Exception as e:  # noqa: BLE001 (raised by the generator, or pickling a value)
            _close(result)
            if held is not None:  # it raised after its last value: that ref holds the error
                discard(held)
                produced = k - 1
            self.done(tid, produced, encode_error(e))
            return
        if produced < k:
            self.done(tid, produced, encode_error(ReturnCountError(
                f"{label} was submitted with num_returns={k} but produced {produced} values: "
                f"refs {produced} to {k - 1} hold this error", k, produced)))
            return
        if held is not None and k - 1 >= skip:
            self.item(tid, k - 1, held)
        elif held is not None:
            discard(held)
        self.done(tid, k)

    def run_stream(self, tid: int, result: Any, streaming: bool, max_buffered: int,
                   skip: int, consumed: int) -> None:
        try:
            it = iter(result)
        except TypeError as e:
            self.done(tid, 0, encode_error(TypeError(
                f"num_returns='dynamic' or 'streaming' needs a generator (or any iterable); "
                f"the task returned a {type(result).__name__}: {e}")))
            return
        del result
        produced = 0
        # A re-run (max_retries) skips what was delivered; the consumer may be behind that.
        allowed = consumed + max_buffered if max_buffered else -1
        waiting = False
        try:
            while True:
                try:
                    value = next(it)
                except StopIteration:
                    break
                wire = encode(value)
                del value  # Note [One value at a time]
                if produced >= skip:
                    self.item(tid, produced, wire)
                else:
                    discard(wire)
                produced += 1
                if not streaming:
                    continue
                consumed = self.control(tid, block=False)
                while consumed is not False or (allowed >= 0 and produced >= allowed):
                    if consumed is None:  # CANCEL: GeneratorExit at its yield
                        _close(it)
                        self.done(tid, produced, None, FLAG_CANCELLED)
                        return
                    if consumed is not False:
                        allowed = consumed + max_buffered
                        waiting = False
                        if produced < allowed:
                            consumed = self.control(tid, block=False)
                            continue
                    if not waiting:  # back-pressure: tell the owner, wait for a credit
                        self.results.put((WAIT, self.wid, tid))
                        waiting = True
                    consumed = self.control(tid, block=True)
        except Exception as e:  # noqa: BLE001 (the generator raised, or a value did not pickle)
            _close(it)
            self.done(tid, produced, encode_error(e))
            return
        self.done(tid, produced)


def _close(it: Any) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001 (an error in its finally: the task ends anyway)
            pass
