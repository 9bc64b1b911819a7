"""Starting worker processes and joining them: ``spawn``, ``start_processes``, ``ProcessContext``.

Adapted from torch/multiprocessing/spawn.py (torch 2.13); changes: the child's exception
object travels with its traceback and becomes the ``__cause__`` of the parent's
``ProcessRaisedException``; deaths by signal are explained (an OOM kill, SIGBUS from a full
``/dev/shm``, a segfault with the child's stack from ``faulthandler``); every failed process is
listed, not only the first; ``fn`` takes keyword arguments (``kwargs=``) and its return values
can be had (``return_values=True``, Note [Return values] in ``worker.py``); error files live
in one private directory removed once read (torch leaves them in ``/tmp``); children get
``PR_SET_PDEATHSIG(SIGKILL)``, not SIGINT; processes already started are killed when a later
one fails to start; ``start_method="forkserver"`` uses
torch_mp_ext's fast forkserver (torch and ``__main__`` preloaded), workers started in parallel
unless ``TORCH_MP_PARALLEL_START=0``. The worker side (``wrap``, the error files, Note
[Children die with their parent]) is in ``worker.py``.

Same signatures, defaults, messages, warnings and log records as torch, so code and tests that
match on them keep working: the join algorithm (first failure, ``grace_period``, SIGTERM,
``grace_period`` or 30 s, SIGKILL) is torch's line for line.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import tempfile
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..errors import (
    ProcessException,
    ProcessExitedException,
    ProcessFailure,
    ProcessRaisedException,
)
from ..timeouts import seconds
from . import exits as _exits
from . import forkserver as _forkserver
from .context import default_context
from .worker import (
    FAULT_SUFFIX,
    RESULT_SUFFIX,
    read_error_file,
    read_result_file,
    remove_files,
    wrap,
)

ENV_VAR_PARALLEL_START = "TORCH_MP_PARALLEL_START"
"""torch's environment variable: ``0`` starts forkserver workers one after another through
the standard library's forkserver (torch's behaviour); ``1`` or unset, the fast path.

Example:
    ```python
    import os
    import torch_mp_ext as mp

    os.environ[mp.ENV_VAR_PARALLEL_START] = "0"   # torch's one-at-a-time forkserver starts
    ```
"""

# torch's logger name: handlers, filters and tests written for torch see our records too.
log = logging.getLogger("torch.multiprocessing.spawn")

__all__ = [
    "ENV_VAR_PARALLEL_START",
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "SpawnContext",
    "spawn",
    "start_processes",
]

class ProcessContext:
    """The processes started by :func:`start_processes`, joined together.

    Args:
        processes: the started ``Process`` objects, in index order.
        error_files: for each process, the path its ``fn``'s exception is written to.

    Attributes:
        processes: as given.
        error_files: as given.
        sentinels: ``Process.sentinel`` -> index, for the processes not yet joined.
        results: with ``return_values=True``, once :meth:`join` has returned True: what
            ``fn`` returned in each process, in index order (Note [Return values] in
            ``worker.py``); None until then, and without ``return_values``.

    Example:
        ```python
        import torch_mp_ext as mp

        def work(rank):
            return rank * 10

        if __name__ == "__main__":
            pc = mp.start_processes(work, nprocs=2, join=False, start_method="fork",
                                    return_values=True)
            while not pc.join(timeout=60):   # True once every process exited cleanly
                pass
            assert pc.results == [0, 10]
        ```
    """

    # Set by start_processes: the OOM counters before start (see processes/exits.py) and the
    # directory holding the error files.
    _oom_before: dict[str, int] | None = None
    _keep_results = False
    results: list[Any] | None = None

    def __init__(self, processes: list[Any], error_files: list[str]) -> None:
        self.error_files = error_files
        self.processes = processes
        self.sentinels = {process.sentinel: index for index, process in enumerate(processes)}
        self._signalled: set[int] = set()
        self._cleanup = weakref.finalize(self, remove_files, list(error_files), None)

    def _own_directory(self, directory: str) -> None:
        self._cleanup.detach()
        self._cleanup = weakref.finalize(self, remove_files, list(self.error_files), directory)

    def pids(self) -> list[int]:
        """The processes' pids, in index order."""
        return [int(process.pid) for process in self.processes]

    def _join_procs_with_timeout(self, timeout: float) -> None:
        """Joins all processes against one shared deadline."""
        end = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, end - time.monotonic()))

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Joins the processes; raises if one of them failed.

        Waits until a process exits. If one exited with a non-zero status, the others get
        ``grace_period`` seconds to exit on their own (none by default), then SIGTERM, then
        ``grace_period`` seconds more (30 by default), then SIGKILL; the failure is raised.

        Args:
            timeout: seconds to wait for a process to exit; None waits as long as it takes.
                It does not bound the shutdown that follows a failure.
            grace_period: seconds the other processes get before each signal, after a failure.

        Returns:
            True when every process has exited successfully (and on any later call then),
            False if some are still running.

        Raises:
            ProcessRaisedException: ``fn`` raised in a process; the child's exception, when it
                could be pickled, is the ``__cause__``.
            ProcessExitedException: a process exited with a non-zero code or a signal.
        """
        # Ensure this function can be called even when we're done.
        if len(self.sentinels) == 0:
            return True
        # Wait for any process to fail or all of them to succeed.
        timeout = seconds(timeout, negative_ok=True)  # Note [Timeout values]
        ready = multiprocessing.connection.wait(self.sentinels.keys(), timeout=timeout)
        error_index = None
        for sentinel in ready:
            index = self.sentinels.pop(sentinel)
            process = self.processes[index]
            process.join()
            if process.exitcode != 0:
                error_index = index
                break
        if error_index is None:
            if len(self.sentinels) == 0:
                try:
                    if self._keep_results:  # Note [Return values]
                        self.results = [read_result_file(path + RESULT_SUFFIX)
                                        for path in self.error_files]
                finally:
                    self._cleanup()
                return True
            return False
        # An error occurred: clean up all processes before raising.
        self._stop_all(grace_period)
        try:
            raise self._exception(error_index)
        finally:
            self._cleanup()

    def _stop_all(self, grace_period: float | None) -> None:
        # First, allow a grace period for processes to shut down themselves.
        if grace_period is not None:
            self._join_procs_with_timeout(grace_period)
        # Then terminate processes that are still alive. Try SIGTERM first.
        for index, process in enumerate(self.processes):
            if process.is_alive():
                log.warning("Terminating process %s via signal SIGTERM", process.pid)
                self._signalled.add(index)
                process.terminate()
        # SIGKILL after another grace period: Python handles signals in the main thread only,
        # and a main thread stuck in native code never does.
        self._join_procs_with_timeout(30 if grace_period is None else grace_period)
        for process in self.processes:
            if process.is_alive():
                log.warning(
                    "Unable to shutdown process %s via SIGTERM , forcefully exiting via SIGKILL",
                    process.pid,
                )
                process.kill()
            process.join()

    def _describe(self, index: int) -> tuple[ProcessFailure, str, BaseException | None]:
        """(failure record, text to show, the child's exception) for a failed process."""
        process = self.processes[index]
        code = process.exitcode
        record = read_error_file(self.error_files[index])
        if record is not None:
            text, exc = record
            reason = "raised"
        else:
            exc = None
            fault = _exits.read_fault_file(self.error_files[index] + FAULT_SUFFIX)
            reason, text = _exits.explain_exit(code, oom_before=self._oom_before, fault_text=fault)
        name = _exits.signal_name(-code) if code is not None and code < 0 else None
        summary = _exits.summarize(reason, code, text)
        return ProcessFailure(index, process.pid, code, name, reason, summary), text, exc

    def _failed(self, index: int) -> bool:
        """Failed on its own: not merely ended by the shutdown signals sent after a failure."""
        code = self.processes[index].exitcode
        return code not in (0, None) and (
            index not in self._signalled or os.path.exists(self.error_files[index]))

    def _exception(self, error_index: int) -> ProcessException:
        failure, text, exc = self._describe(error_index)
        failures = [failure] + [self._describe(i)[0] for i in range(len(self.processes))
                                if i != error_index and self._failed(i)]
        listing = ""
        if len(failures) > 1:
            listing = f"\n\n-- {len(failures)} processes failed, the first is reported:\n"
            listing += "\n".join(
                f"   process {f.index:d} (pid {f.pid}): {f.summary}" for f in failures)
        pid: Any = failure.pid
        error: ProcessException
        if failure.reason == "raised":
            msg = f"{listing}\n\n-- Process {error_index:d} terminated with the following error:\n"
            error = ProcessRaisedException(msg + text, error_index, pid)
            error.__cause__ = exc
        else:
            code: Any = failure.exit_code
            if failure.signal_name is not None:
                msg = f"process {error_index:d} terminated with signal {failure.signal_name}"
            else:
                msg = f"process {error_index:d} terminated with exit code {code:d}"
            msg += ("\n" + text if text else "") + listing
            error = ProcessExitedException(msg, error_index, pid, code, failure.signal_name)
        error.failures = tuple(failures)
        return error


class SpawnContext(ProcessContext):
    """The old name of :class:`ProcessContext` (warns).

    Example:
        ```python
        import torch_mp_ext as mp

        assert issubclass(mp.SpawnContext, mp.ProcessContext)   # use ProcessContext
        ```
    """

    def __init__(self, processes: list[Any], error_files: list[str]) -> None:
        warnings.warn("SpawnContext is renamed to ProcessContext since 1.4 release.", stacklevel=2)
        super().__init__(processes, error_files)


def launch_plan(start_method: str) -> tuple[Any, bool, tuple[str, int | None]]:
    """(context, start in parallel, how children watch their parent) for a start method."""
    ctx = default_context.get_context(start_method)
    if start_method == "forkserver":
        parallel = os.environ.get(ENV_VAR_PARALLEL_START) != "0"
        if parallel:
            log.info("Starting processes in parallel.")
        return ctx, parallel, ("pdeathsig", _forkserver.ensure_running())
    # Note [Children die with their parent]: PDEATHSIG follows the starting thread.
    on_main = threading.current_thread() is threading.main_thread()
    return ctx, False, ("pdeathsig" if on_main else "process", os.getpid())


# Note: [start_processes]
# mp.start_processes handles every start method; mp.spawn is its documented, CUDA-safe case.
def start_processes(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
    *,
    kwargs: dict[str, Any] | None = None,
    return_values: bool = False,
) -> ProcessContext | list[Any] | None:
    """Starts ``nprocs`` processes running ``fn(i, *args, **kwargs)``, ``i`` in ``range(nprocs)``.

    ``start_method`` is ``"spawn"``, ``"fork"`` or ``"forkserver"``. With ``"forkserver"``
    the workers fork from torch_mp_ext's fast server, which has torch and the main module
    imported already, and start in parallel; ``TORCH_MP_PARALLEL_START=0`` starts them one
    after another, as torch does.

    Args:
        fn: the entry point. Pickled for spawn and forkserver: a lambda or a local function
            is pickled by value (Note [By-value fallback] in ``sharing/byvalue.py``).
        args: passed to ``fn`` after the process index.
        nprocs: how many processes.
        join: join them (and raise if one fails) before returning.
        daemon: the processes' daemon flag.
        start_method: the multiprocessing start method.
        kwargs: keyword arguments for ``fn``.
        return_values: keep what ``fn`` returns in each process (Note [Return values]).

    Returns:
        If ``join``: None, or with ``return_values`` the list of ``fn``'s return values in
        index order. Else the :class:`ProcessContext` to join (``results`` once joined).

    Raises:
        ProcessRaisedException, ProcessExitedException: see :meth:`ProcessContext.join`.
        TypeError: ``kwargs`` is not a dict with string keys.

    Example:
        ```python
        import torch_mp_ext as mp

        def train(rank, world_size):
            return f"rank {rank} of {world_size}"

        if __name__ == "__main__":
            out = mp.start_processes(train, args=(2,), nprocs=2, start_method="fork",
                                     return_values=True)
            assert out == ["rank 0 of 2", "rank 1 of 2"]
        ```
    """
    kwargs = _check_kwargs(kwargs)
    ctx, parallel, parent = launch_plan(start_method)
    directory = tempfile.mkdtemp(prefix="torch_mp_ext-errors-")
    # Each process is assigned a file to write its exception to: the file existing means fn
    # raised (vs an expected shutdown).
    error_files = [os.path.join(directory, f"{i}.pickle") for i in range(nprocs)]
    oom_before = _exits.oom_kill_counts()

    def start_process(i: int) -> Any:
        process = ctx.Process(target=wrap, daemon=daemon, args=(
            fn, i, args, error_files[i], parent, kwargs, bool(return_values)))
        process.start()
        return process

    processes: list[Any] = []
    try:
        if parallel and nprocs > 1:
            with ThreadPoolExecutor(max_workers=min(nprocs, 32)) as executor:
                futures = [executor.submit(start_process, i) for i in range(nprocs)]
            processes = [f.result() for f in futures if f.exception() is None]
            for f in futures:
                if f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
        else:
            for i in range(nprocs):
                processes.append(start_process(i))
    except BaseException:
        for process in processes:  # the ones that did start must not outlive the error
            process.kill()
            process.join()
        remove_files(error_files, directory)
        raise
    context = ProcessContext(processes, error_files)
    context._own_directory(directory)
    context._oom_before = oom_before
    context._keep_results = bool(return_values)
    if not join:
        return context
    # Loop on join until it returns True or raises an exception.
    while not context.join():
        pass
    return context.results if return_values else None


def _check_kwargs(kwargs: Any) -> dict[str, Any] | None:
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"kwargs must be a dict of keyword arguments for fn, got "
                        f"{type(kwargs).__name__}")
    return dict(kwargs)


def spawn(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
    *,
    kwargs: dict[str, Any] | None = None,
    return_values: bool = False,
) -> ProcessContext | list[Any] | None:
    """Spawns ``nprocs`` fresh interpreters running ``fn(i, *args, **kwargs)``.

    If one of the processes fails, the others are stopped and the failure is raised: the
    child's exception with its traceback (:class:`ProcessRaisedException`), or the exit code
    or signal explained (:class:`ProcessExitedException`).

    Args:
        fn: the entry point (pickled: a lambda or a local function is pickled by value).
        args: passed to ``fn`` after the process index.
        nprocs: how many processes.
        join: join them before returning.
        daemon: the processes' daemon flag.
        start_method: deprecated; always ``"spawn"`` (warns otherwise). Use
            :func:`start_processes` for the others, ``"forkserver"`` for a fast start.
        kwargs: keyword arguments for ``fn``.
        return_values: keep what ``fn`` returns in each process.

    Returns:
        If ``join``: None, or with ``return_values`` the list of ``fn``'s return values in
        index order. Else the :class:`ProcessContext` to join (``results`` once joined).

    Example:
        ```python
        import torch_mp_ext as mp

        def train(rank):
            if rank == 1:
                raise ValueError("bad shard")

        if __name__ == "__main__":
            try:
                mp.spawn(train, nprocs=2)
            except mp.ProcessRaisedException as e:
                assert isinstance(e.__cause__, ValueError)   # the child's exception object
        ```
    """
    if start_method != "spawn":
        msg = (
            f"This method only supports start_method=spawn (got: {start_method}).\n"
            "To use a different start_method use:\n\t\t"
            " torch.multiprocessing.start_processes(...)"
        )
        warnings.warn(msg, FutureWarning, stacklevel=2)
    return start_processes(fn, args, nprocs, join, daemon, start_method="spawn", kwargs=kwargs,
                           return_values=return_values)
