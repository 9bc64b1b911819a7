"""``torch_mp_ext.DataLoader``: torch's DataLoader that says why a worker died, and can
replace it without losing the epoch.

Note [Replacing a DataLoader worker]
torch's multi-process iterator numbers each batch it asks for (the task index), sends
``(task, sampler indices)`` to one worker's index queue, and yields results in task order
(``in_order=True``). Ours (:class:`_WorkerReplacingIter`, a subclass) keeps the sampler
indices of every task not yet received (``_tmx_sent``). When a worker is found dead (torch's
own liveness check, every ``MP_STATUS_CHECK_INTERVAL`` seconds without a result) or hung (no
result for ``timeout`` seconds while it owed one), a new process takes its *slot*: the same
worker id, seed and arguments, a new index queue, and the tasks the slot still owes, re-sent
in task order under their old task numbers. Every bookkeeping structure of torch's (task
info, tasks per worker, tasks outstanding, the round-robin cycle) keys on the slot, so none
changes, and the epoch yields the same batches in the same order as without the death.

A dead worker may have committed a result to the (crash-safe) result queue before it died;
the replacement then makes the same task again. The first result for a task wins, a second
one is dropped (:meth:`_WorkerReplacingIter._tmx_accept`); a result whose shared memory went
with its sender fails to unpickle and is dropped too, its task being owed still. What cannot
be replayed is a worker's private state: a replacement starts its random generators afresh
(from the same seed), and an ``IterableDataset``'s position in its stream is lost, so
``max_worker_restarts`` needs a map-style dataset.

Note [Worker deaths without torch's SIGCHLD handler]
torch registers its workers' pids with a SIGCHLD handler that raises "DataLoader worker ...
is killed by signal" in the main thread, wherever it is, as soon as one dies; that would end
the epoch before a replacement could start, and its message cannot carry the cause. Our
iterator takes its workers off that list right after torch's constructor put them there
(a death within those microseconds is still reported by torch), and finds deaths itself,
through the same liveness check torch uses where it has no SIGCHLD (forkserver workers are
the server's children): a death is noticed within ``MP_STATUS_CHECK_INTERVAL`` (5 s) of the
result queue falling quiet.
"""

from __future__ import annotations

import inspect
import multiprocessing.connection
import queue
import re
import shutil
import tempfile
import time
import warnings
import weakref
from typing import Any

import torch
from torch.utils.data import DataLoader as _TorchDataLoader

from .. import torch_internals as _ti
from ..errors import DataLoaderWorkerError, WorkerRestartWarning
from . import exits, worker_reports
from .context import default_context, is_ours

# The pid in the error of a handle whose sender has exited (csrc/ipc/fd_server.cpp).
_SENDER = re.compile(r"\(pid (\d+)\) has exited before this process received")

__all__ = ["DataLoader"]

_RESTART_CONTEXTS = "torch_mp_ext.get_context('fork' | 'spawn' | 'forkserver')"


class DataLoader(_TorchDataLoader):
    """torch's ``DataLoader``, whose workers are torch_mp_ext's, report why they died, and
    may be replaced without losing the epoch.

    Every argument is torch's, with the same default, except ``multiprocessing_context``:
    None (or a start method's name) means torch_mp_ext's context for that start method, so
    batches are built in the shared-memory arena (docs/dataloader.md).

    Args:
        max_worker_restarts: how many workers may die or hang per epoch (per ``iter()``)
            and be replaced, their unfinished batches made again by the replacement, with a
            :class:`~torch_mp_ext.errors.WorkerRestartWarning` naming the cause. 0 (the
            default): the first death raises, as in torch. A hung worker is one that owes a
            batch and produced nothing for ``timeout`` seconds; with ``timeout=0`` (torch's
            default) only deaths are noticed. Needs a map-style dataset and one of
            torch_mp_ext's contexts.

    Raises:
        ValueError: ``max_worker_restarts`` negative, or set with an ``IterableDataset``
            or with another library's ``multiprocessing_context``.

    A worker death that is not replaced raises
    :class:`~torch_mp_ext.errors.DataLoaderWorkerError` (a ``RuntimeError``): torch's message
    ("DataLoader worker (pid 12) is killed by signal: Killed.") followed by the cause.

    Example:
        ```python
        import torch
        import torch_mp_ext as mp

        if __name__ == "__main__":
            data = torch.utils.data.TensorDataset(torch.arange(64.0))
            loader = mp.DataLoader(data, batch_size=16, num_workers=2, max_worker_restarts=1)
            assert sum(batch.sum().item() for (batch,) in loader) == sum(range(64))
        ```
    """

    def __init__(self, dataset: Any, *args: Any, max_worker_restarts: int = 0,
                 **kwargs: Any) -> None:
        if (isinstance(max_worker_restarts, bool) or not isinstance(max_worker_restarts, int)
                or max_worker_restarts < 0):
            raise ValueError("max_worker_restarts should be a non-negative integer, but got "
                             f"max_worker_restarts={max_worker_restarts!r}")
        self.max_worker_restarts = max_worker_restarts
        super().__init__(dataset, *args, **kwargs)
        if max_worker_restarts and self._dataset_kind == _ti.DatasetKind.Iterable:
            raise ValueError(
                "max_worker_restarts needs a map-style dataset: a worker of an "
                "IterableDataset holds its position in the stream, which a replacement "
                "cannot resume. Use max_worker_restarts=0 with this dataset.")
        self._tmx_check_context()

    @property  # type: ignore[override]
    def multiprocessing_context(self) -> Any:
        """The context workers start from: torch_mp_ext's, for the current start method,
        unless another was given."""
        ctx = _TorchDataLoader.multiprocessing_context.fget(self)  # type: ignore[attr-defined]
        if ctx is None and self.num_workers > 0:
            return default_context.get_context()
        return ctx

    @multiprocessing_context.setter
    def multiprocessing_context(self, value: Any) -> None:
        setter = _TorchDataLoader.multiprocessing_context.fset  # type: ignore[attr-defined]
        setter(self, value)  # torch's checks and messages
        if isinstance(value, str):
            setter(self, default_context.get_context(value))

    def _tmx_check_context(self) -> None:
        # The context given, if any: resolving the default here would fix the start method.
        ctx = _TorchDataLoader.multiprocessing_context.fget(self)  # type: ignore[attr-defined]
        if self.max_worker_restarts and ctx is not None and not is_ours(ctx):
            raise ValueError(
                f"max_worker_restarts needs one of torch_mp_ext's contexts ({_RESTART_CONTEXTS}"
                f"), whose result queue stays whole when a worker dies mid-put; got "
                f"multiprocessing_context={ctx!r}. Pass a start method's name instead.")

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        self._tmx_check_context()
        self.check_worker_number_rationality()
        return _WorkerReplacingIter(self)


def _worker_loop_kwargs(it: Any, slot: int, index_queue: Any) -> dict[str, Any]:
    """The arguments torch's constructor gave the worker of ``slot`` (``Process.start``
    drops its own copy), by the worker loop's parameter names, with a new index queue."""
    known = {
        "dataset_kind": it._dataset_kind, "dataset": it._dataset, "index_queue": index_queue,
        # torch >= 2.14: a list the worker empties, so its Process does not keep the dataset
        "dataset_holder": [it._dataset],
        "data_queue": it._worker_result_queue, "done_event": it._workers_done_event,
        "auto_collation": it._auto_collation, "collate_fn": it._collate_fn,
        "drop_last": it._drop_last, "base_seed": it._base_seed, "init_fn": it._worker_init_fn,
        "worker_id": slot, "num_workers": it._num_workers,
        "persistent_workers": it._persistent_workers, "shared_seed": it._shared_seed,
    }
    names = list(inspect.signature(_ti.worker_loop).parameters)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise RuntimeError(
            "torch's DataLoader worker loop (torch.utils.data._utils.worker._worker_loop) takes "
            f"arguments torch_mp_ext does not know in this torch ({torch.__version__}): "
            f"{', '.join(unknown)}. torch_mp_ext cannot start a replacement worker; use "
            "max_worker_restarts=0")
    return {name: known[name] for name in names}


class _WorkerReplacingIter(_ti.MultiProcessingDataLoaderIter):
    """Note [Replacing a DataLoader worker], Note [Worker deaths without torch's SIGCHLD
    handler]. Attributes of ours start with ``_tmx_``."""

    def __init__(self, loader: DataLoader) -> None:
        self._tmx_ctx = loader.multiprocessing_context
        self._tmx_max_restarts = loader.max_worker_restarts
        self._tmx_dir = tempfile.mkdtemp(prefix="torch_mp_ext-loader-")
        self._tmx_cleanup = weakref.finalize(self, shutil.rmtree, self._tmx_dir, True)
        oom = exits.oom_kill_counts()
        super().__init__(loader)
        if self._worker_pids_set:  # Note [Worker deaths without torch's SIGCHLD handler]
            _ti.remove_worker_pids(id(self))
            self._worker_pids_set = False
        self._tmx_oom = [oom] * self._num_workers
        self._tmx_gone: set[int] = set()  # pids of the workers replaced so far

    # torch's constructor passes this to every worker: ours wraps the user's function.
    @property
    def _worker_init_fn(self) -> Any:
        return self._tmx_worker_start

    @_worker_init_fn.setter
    def _worker_init_fn(self, fn: Any) -> None:
        self._tmx_worker_start = worker_reports.WorkerStart(fn, self._tmx_dir)

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        n = self._num_workers
        self._tmx_sent: dict[int, Any] = {}  # task -> sampler indices, until received
        self._tmx_owed = [0] * n  # tasks sent to each slot and not received
        self._tmx_since = [time.monotonic()] * n  # the slot's last sign of progress
        self._tmx_restarts = 0
        self._tmx_resuming = not first_iter  # torch waits for one ack per worker
        try:
            super()._reset(loader, first_iter)
        finally:
            self._tmx_resuming = False

    def _next_index(self) -> Any:
        self._tmx_index = super()._next_index()
        return self._tmx_index

    def _try_put_index(self) -> None:
        task = self._send_idx
        super()._try_put_index()
        if self._send_idx != task:
            self._tmx_sent[task] = self._tmx_index
            slot = self._task_info[task][0]
            if self._tmx_owed[slot] == 0:
                self._tmx_since[slot] = time.monotonic()
            self._tmx_owed[slot] += 1

    def _try_get_data(self, timeout: float = _ti.MP_STATUS_CHECK_INTERVAL) -> tuple:
        try:
            return True, self._data_queue.get(timeout=timeout)
        except queue.Empty:
            pass
        except OSError as exc:
            # A result whose sender died with its shared memory (Note [Replacing a
            # DataLoader worker]): dropped, its task is still owed. Its sender may have been
            # replaced already (its result was still in the queue); else its death may not be
            # visible yet (a forkserver worker is reaped by the server): wait for it.
            sender = _SENDER.search(str(exc))
            if sender is None or int(sender.group(1)) not in self._tmx_gone:
                sentinels = [w.sentinel for slot, w in enumerate(self._workers)
                             if self._workers_status[slot]]
                if not multiprocessing.connection.wait(sentinels,
                                                       _ti.MP_STATUS_CHECK_INTERVAL):
                    raise
        for slot in self._tmx_dead_slots():
            self._tmx_replace(slot, hung=False)
        return False, None

    def _get_data(self) -> Any:
        entered = time.monotonic()
        while True:
            if self._pin_memory and not self._pin_memory_thread.is_alive():
                raise RuntimeError("Pin memory thread exited unexpectedly")
            ok, item = self._try_get_data(self._tmx_wait(entered))
            if ok:
                if self._tmx_accept(item):
                    return item
            elif self._timeout > 0:
                for slot in self._tmx_hung_slots(entered):
                    self._tmx_replace(slot, hung=True)

    def _shutdown_workers(self) -> None:
        try:
            super()._shutdown_workers()
        finally:
            cleanup = getattr(self, "_tmx_cleanup", None)
            if cleanup is not None and getattr(self, "_shutdown", False):
                cleanup()

    # ---- ours ----

    def _tmx_accept(self, item: Any) -> bool:
        """False for a result to drop: a task's second result, or a stale resume ack."""
        task = item[0]
        if isinstance(task, int):
            info = self._task_info.get(task)
            if info is None or len(info) != 1:
                return False  # received already (from a worker that then died)
            slot = info[0]
            self._tmx_owed[slot] -= 1
            self._tmx_since[slot] = time.monotonic()
            self._tmx_sent.pop(task, None)
            return True
        if isinstance(task, _ti.ResumeIteration):
            return self._tmx_resuming
        return True

    def _tmx_start(self, slot: int, entered: float) -> float:
        """When the slot's wait for a result began, for its ``timeout``."""
        if self._tmx_max_restarts:
            return max(entered, self._tmx_since[slot])
        return entered  # torch's meaning: no result at all for `timeout` seconds

    def _tmx_wait(self, entered: float) -> float:
        wait = _ti.MP_STATUS_CHECK_INTERVAL
        if self._timeout > 0:
            now = time.monotonic()
            for slot in range(self._num_workers):
                if self._tmx_owed[slot] > 0 and self._workers_status[slot]:
                    wait = min(wait, self._tmx_start(slot, entered) + self._timeout - now)
        return max(wait, 0.0)

    def _tmx_dead_slots(self) -> list[int]:
        return [slot for slot, w in enumerate(self._workers)
                if self._workers_status[slot] and not w.is_alive()]

    def _tmx_hung_slots(self, entered: float) -> list[int]:
        now = time.monotonic()
        return [slot for slot in range(self._num_workers)
                if self._workers_status[slot] and self._tmx_owed[slot] > 0
                and now - self._tmx_start(slot, entered) >= self._timeout]

    def _tmx_replace(self, slot: int, hung: bool) -> None:
        """Replaces the dead or hung worker of ``slot``, or raises when none may replace it."""
        old = self._workers[slot]
        path = worker_reports.fault_path(self._tmx_dir, old.pid)
        if hung:
            stack = worker_reports.stop_hung(old, path)
            reason, code = "hung", None
            message = (f"DataLoader timed out after {self._timeout} seconds\n"
                       + worker_reports.hang_report(slot, old.pid, self._timeout, stack))
        else:
            old.join(_ti.MP_STATUS_CHECK_INTERVAL)
            code = old.exitcode
            message, reason = worker_reports.explain_death(old.pid, code, path,
                                                           self._tmx_oom[slot])
        owed = sorted(t for t, info in self._task_info.items()
                      if len(info) == 1 and info[0] == slot)
        if self._tmx_restarts >= self._tmx_max_restarts:
            self._mark_worker_as_unavailable(slot)
            if self._tmx_max_restarts:
                message += (f"\nThe loader had replaced {self._tmx_restarts} worker(s) this "
                            f"epoch already (max_worker_restarts={self._tmx_max_restarts}).")
            raise DataLoaderWorkerError(
                message, worker_id=slot, pid=old.pid, exit_code=code, reason=reason,
                signal_name=exits.signal_name(-code) if code is not None and code < 0 else None)
        self._tmx_restarts += 1
        self._tmx_gone.add(old.pid)
        new = self._tmx_start_worker(slot, old, owed)
        warnings.warn(
            f"{message}\ntorch_mp_ext replaced DataLoader worker {slot} (new pid {new.pid}, "
            f"replacement {self._tmx_restarts} of max_worker_restarts="
            f"{self._tmx_max_restarts} this epoch); it makes the {len(owed)} batch(es) the "
            "old one owed, and the epoch goes on.", WorkerRestartWarning, stacklevel=2)

    def _tmx_start_worker(self, slot: int, old: Any, owed: list[int]) -> Any:
        index_queue = self._tmx_ctx.Queue()
        index_queue.cancel_join_thread()
        new = self._tmx_ctx.Process(target=_ti.worker_loop,
                                    kwargs=_worker_loop_kwargs(self, slot, index_queue))
        new.daemon = True
        self._tmx_oom[slot] = exits.oom_kill_counts()
        new.start()
        old_queue, self._index_queues[slot], self._workers[slot] = (
            self._index_queues[slot], index_queue, new)
        old_queue.cancel_join_thread()
        old_queue.close()
        old.close()
        self._tmx_since[slot] = time.monotonic()
        if self._tmx_resuming:  # torch's _reset counts one ack per worker
            index_queue.put(_ti.ResumeIteration(self._shared_seed))
        for task in owed:
            index_queue.put((task, self._tmx_sent[task]))
        return new
