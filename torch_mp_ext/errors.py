"""Every exception torch_mp_ext raises, in one place.

Each project exception also subclasses the builtin it resembles, so existing ``except``
clauses keep working: a full ``/dev/shm`` is an ``OSError``, a closed queue a ``ValueError``,
an unknown sharing strategy both a ``ValueError`` (what users expect) and an
``AssertionError`` (what torch.multiprocessing 2.13 raises).

Exceptions that cross process boundaries pickle, and carry the remote traceback as their
``__cause__`` (the pattern of loky and ``concurrent.futures``): see :func:`with_traceback`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno as _errno
import resource as _resource
import traceback
from typing import Any

from torch.multiprocessing.spawn import ProcessException as _TorchProcessException
from torch.multiprocessing.spawn import ProcessExitedException as _TorchProcessExitedException
from torch.multiprocessing.spawn import ProcessRaisedException as _TorchProcessRaisedException

__all__ = [
    "TorchMPExtError",
    "SharedMemoryError",
    "SharedMemoryLimitError",
    "CorruptSegmentError",
    "PeerDiedError",
    "InvalidSharingStrategyError",
    "ChannelClosedError",
    "BorrowedWriteError",
    "CudaSharingWarning",
    "ForkAfterThreadsWarning",
    "TorchVersionError",
    "UntestedTorchWarning",
    "DataLoaderWorkerError",
    "WorkerRestartWarning",
    "QueueClosedError",
    "PipelineError",
    "TaskError",
    "RemoteTaskError",
    "ReturnCountError",
    "WorkerDiedError",
    "TaskCancelledError",
    "GetTimeoutError",
    "PoolClosedError",
    "ProcessException",
    "ProcessRaisedException",
    "ProcessExitedException",
    "ProcessFailure",
    "RemoteTraceback",
    "ExceptionWithTraceback",
    "with_traceback",
    "oserror",
]


class TorchMPExtError(Exception):
    """Base class of the exceptions defined by torch_mp_ext.

    Example:
        ```python
        import torch_mp_ext as mp
        from torch_mp_ext.errors import TorchMPExtError

        try:
            mp.set_sharing_strategy("shared")
        except TorchMPExtError as e:   # every exception torch_mp_ext defines
            print(type(e).__name__, e)
        ```
    """


class SharedMemoryError(TorchMPExtError, OSError):
    """Shared memory could not be had: ``/dev/shm`` full, memory limit, fd limit.

    ``errno``, ``strerror`` (the whole explanation, with the fix) and ``filename`` (the
    resource) are set as for any ``OSError``.

    Example:
        ```python
        import torch_mp_ext as mp
        from torch_mp_ext.errors import SharedMemoryError

        try:
            buffer = mp.empty(1 << 20)
        except SharedMemoryError as e:   # an OSError: e.errno is ENOSPC, EMFILE, ...
            raise SystemExit(f"no shared memory: {e}")
        ```
    """


class SharedMemoryLimitError(SharedMemoryError, MemoryError, RuntimeError):
    """A request for more shared memory than this machine, its memory cgroup or (for the
    ``file_system`` strategy) ``/dev/shm`` can ever hold, refused before anything is reserved.

    A :class:`SharedMemoryError` (an ``OSError``, ``errno.ENOMEM``), a ``MemoryError``, and a
    ``RuntimeError``, which is what ``torch.empty`` raises for such a size ("can't allocate
    memory"): ``except`` clauses written for either keep matching.

    Example:
        ```python
        import torch_mp_ext as mp
        from torch_mp_ext.errors import SharedMemoryLimitError

        try:
            mp.empty(1 << 43)   # 32 TiB of float32
        except SharedMemoryLimitError as e:   # also a MemoryError: nothing was reserved
            assert "cannot allocate" in str(e)
        ```
    """


class CorruptSegmentError(TorchMPExtError, RuntimeError):
    """A shared-memory segment is not ours, of another layout version, or a handle is stale.

    Example:
        ```python
        import torch_mp_ext as mp
        from torch_mp_ext.errors import CorruptSegmentError
        from torch_mp_ext.reductions import reduce_storage

        rebuild, (cls, handle, offset, nbytes) = reduce_storage(mp.empty(4).untyped_storage())
        forged = handle[:2] + (handle[2] + 1,) + handle[3:]   # a wrong secret
        try:
            rebuild(cls, forged, offset, nbytes)
        except CorruptSegmentError as e:   # raised, never a crash
            print(e)
        ```
    """


class PeerDiedError(TorchMPExtError, RuntimeError):
    """A process died while holding shared state that could not be repaired.

    Example:
        ```python
        import os
        import signal
        import torch_mp_ext as mp
        from torch_mp_ext.errors import PeerDiedError

        def producer(q):
            q.put(b"x" * (1 << 20))   # 1 MB: out of line, in a block of this process
            os.kill(os.getpid(), signal.SIGKILL)   # gone before anyone mapped it

        if __name__ == "__main__":
            q = mp.Queue()
            p = mp.Process(target=producer, args=(q,))
            p.start()
            p.join(60)
            try:
                q.get(timeout=60)
            except PeerDiedError as e:   # that item only: the queue goes on
                print(e)
            q.put(1)
            assert q.get(timeout=60) == 1
        ```
    """


class QueueClosedError(TorchMPExtError, ValueError):
    """An operation on a queue object that was closed in this process (``multiprocessing``
    raises ``ValueError`` there, so this is one).

    Example:
        ```python
        import torch_mp_ext as mp
        from torch_mp_ext.errors import QueueClosedError

        q = mp.Queue()
        q.close()
        try:
            q.put(1)
        except ValueError as e:   # as multiprocessing raises for a closed queue
            assert isinstance(e, QueueClosedError)
        ```
    """


class PipelineError(TorchMPExtError, RuntimeError):
    """A stage of a :func:`~torch_mp_ext.pipeline` failed: it raised, or its process died.

    When the stage raised, ``__cause__`` is its exception (itself caused by a
    :class:`RemoteTraceback` holding the stage's stack); when it died, the message says how
    (the signal, and what it usually means) and ``__cause__`` is None.

    Attributes:
        stage: the stage's name (its function's ``__qualname__``, or ``"source"``).
        position: 0 for the source, 1 for the first stage, and so on.
        worker: which of the stage's ``workers`` processes failed (0 when it has one).
        pid: that process's pid (this process's for a source iterated here).
        exit_code: ``Process.exitcode`` of a process that died (negative: the signal), else None.
        signal_name: the signal's name (``"SIGKILL"``) when a signal ended it, else None.

    Example:
        ```python
        import torch_mp_ext as mp
        from torch_mp_ext.errors import PipelineError

        def bad(items):
            for x in items:
                yield 1 / x

        if __name__ == "__main__":
            try:
                list(mp.pipeline([1, 0], bad, start_method="fork"))
            except PipelineError as e:   # every stage was stopped
                assert isinstance(e.__cause__, ZeroDivisionError)
        ```
    """

    def __init__(self, message: str, *, stage: str = "", position: int = 0, worker: int = 0,
                 pid: int | None = None, exit_code: int | None = None,
                 signal_name: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.position = position
        self.worker = worker
        self.pid = pid
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> tuple:
        return (_rebuild_pipeline_error, (self.args[0] if self.args else "", self.__dict__))


def _rebuild_pipeline_error(message: str, state: dict) -> PipelineError:
    err = PipelineError(message)
    err.__dict__.update(state)
    return err


class InvalidSharingStrategyError(TorchMPExtError, ValueError, AssertionError):
    """An unknown sharing strategy name (torch 2.13 raises AssertionError for it).

    Example:
        ```python
        import torch_mp_ext as mp
        from torch_mp_ext.errors import InvalidSharingStrategyError

        try:
            mp.set_sharing_strategy("file-system")
        except ValueError as e:   # torch code catching AssertionError catches it too
            assert isinstance(e, (InvalidSharingStrategyError, AssertionError))
        ```
    """


class ChannelClosedError(TorchMPExtError, EOFError):
    """A :class:`~torch_mp_ext.StateDictChannel` (or an exchanger on it) was closed: no
    newer version will come, or no version may be published any more.

    Example:
        ```python
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.errors import ChannelClosedError

        channel = mp.StateDictChannel({"w": torch.zeros(3)})
        channel.close()
        try:
            channel.read(timeout=1)
        except ChannelClosedError:   # an EOFError: no version will come
            pass
        ```
    """


class BorrowedWriteError(TorchMPExtError, RuntimeError):
    """A tensor that viewed a borrowed version of a
    :class:`~torch_mp_ext.StateDictChannel` was written in place (an optimizer step,
    BatchNorm's running statistics in train mode, an in-place op under ``no_grad``): the
    write went into shared memory that every collector borrowing that version reads (Note
    [Borrowed versions] in ``csrc/exchange/latest.h``).

    Example:
        ```python
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.errors import BorrowedWriteError

        learner, collector = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
        channel = mp.StateDictChannel(learner)
        channel.publish(learner)
        channel.borrow_into(collector)          # views of version 0, no copy
        with torch.no_grad():
            collector.bias.add_(1)              # a write into every reader's weights
        channel.publish(learner)
        try:
            channel.borrow_into(collector)
        except BorrowedWriteError as e:
            print("caught:", e)
        channel.close()
        ```
    """


class TaskError(TorchMPExtError):
    """Base class of the errors a :class:`~torch_mp_ext.TaskPool` puts in a task's refs.

    Example:
        ```python
        import torch_mp_ext as mp
        from torch_mp_ext.errors import TaskError

        if __name__ == "__main__":
            with mp.TaskPool(1, start_method="fork") as pool:
                pool.shutdown()
                try:
                    pool.submit(abs, -1)
                except TaskError as e:   # any failure the pool reports
                    print(type(e).__name__)
        ```
    """


class RemoteTaskError(TaskError, RuntimeError):
    """A task raised an exception that could not be pickled back: its type name and the
    worker's formatted traceback travel as text (``traceback``).

    Example:
        ```python
        import threading
        import torch_mp_ext as mp
        from torch_mp_ext.errors import RemoteTaskError

        class LockedError(Exception):
            def __init__(self):
                super().__init__("holds a lock")
                self.lock = threading.Lock()   # cannot be pickled back

        def task():
            raise LockedError()

        if __name__ == "__main__":
            with mp.TaskPool(1, start_method="fork") as pool:
                try:
                    pool.submit(task).get(timeout=60)
                except RemoteTaskError as e:   # its type name and traceback, as text
                    assert "LockedError" in str(e)
        ```
    """

    def __init__(self, message: str, traceback_text: str = "") -> None:
        super().__init__(message, traceback_text)
        self.traceback = traceback_text

    def __str__(self) -> str:
        return str(self.args[0])


class ReturnCountError(TaskError, ValueError):
    """A task produced another number of values than ``num_returns`` asked for.

    Attributes:
        expected: ``num_returns``.
        produced: how many values it produced (for too many: how many it had yielded when
            the pool stopped it, ``expected + 1``).

    Example:
        ```python
        import torch_mp_ext as mp
        from torch_mp_ext.errors import ReturnCountError

        def one_value():
            yield 1

        if __name__ == "__main__":
            with mp.TaskPool(1, start_method="fork") as pool:
                first, second = pool.submit(one_value, num_returns=2)
                assert first.get(timeout=60) == 1
                try:
                    second.get(timeout=60)
                except ReturnCountError:
                    pass
        ```
    """

    def __init__(self, message: str, expected: int, produced: int) -> None:
        super().__init__(message, expected, produced)
        self.expected = expected
        self.produced = produced

    def __str__(self) -> str:
        return str(self.args[0])


class WorkerDiedError(TaskError, RuntimeError):
    """The worker process running a task died (a signal, ``os._exit``, the OOM killer).

    Attributes:
        pid: the worker's pid.
        exit_code: its exit code, negative for a signal.
        signal_name: the signal's name (``"SIGKILL"``), or ``None``.

    Example:
        ```python
        import os
        import torch_mp_ext as mp
        from torch_mp_ext.errors import WorkerDiedError

        if __name__ == "__main__":
            with mp.TaskPool(1, start_method="fork") as pool:
                try:
                    pool.submit(os._exit, 3).get(timeout=60)
                except WorkerDiedError as e:   # the pool has started a replacement
                    print(e)
                assert pool.submit(abs, -2).get(timeout=60) == 2
        ```
    """

    def __init__(self, message: str, pid: int | None = None, exit_code: int | None = None,
                 signal_name: str | None = None) -> None:
        super().__init__(message, pid, exit_code, signal_name)
        self.pid = pid
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __str__(self) -> str:
        return str(self.args[0])


class TaskCancelledError(TaskError, concurrent.futures.CancelledError):
    """The task was cancelled (``RefGenerator.cancel()``, or ``shutdown(cancel_pending=True)``)
    before it produced this value.

    Example:
        ```python
        import itertools
        import torch_mp_ext as mp
        from torch_mp_ext.errors import TaskCancelledError

        def forever():
            yield from itertools.count()

        if __name__ == "__main__":
            with mp.TaskPool(1, start_method="fork") as pool:
                stream = pool.submit(forever, num_returns="streaming", max_buffered=4)
                assert next(stream).get(timeout=60) == 0
                stream.cancel()
                try:
                    for ref in stream:
                        ref.get(timeout=60)
                except TaskCancelledError:
                    pass
        ```
    """


class GetTimeoutError(TaskError, TimeoutError):
    """``get``/``next`` with a ``timeout`` found no value in time (the task goes on).

    Example:
        ```python
        import time
        import torch_mp_ext as mp
        from torch_mp_ext.errors import GetTimeoutError

        if __name__ == "__main__":
            with mp.TaskPool(1, start_method="fork") as pool:
                ref = pool.submit(time.sleep, 1.0)
                try:
                    ref.get(timeout=0.01)
                except TimeoutError as e:   # the task goes on: get() again later
                    assert isinstance(e, GetTimeoutError)
                ref.get(timeout=60)
        ```
    """


class PoolClosedError(TaskError, RuntimeError):
    """``submit`` on a :class:`~torch_mp_ext.TaskPool` that was shut down, or a task that the
    shutdown stopped before it ran.

    Example:
        ```python
        import torch_mp_ext as mp
        from torch_mp_ext.errors import PoolClosedError

        if __name__ == "__main__":
            pool = mp.TaskPool(1, start_method="fork")
            pool.shutdown()
            try:
                pool.submit(abs, -1)
            except PoolClosedError:
                pass
        ```
    """


class DataLoaderWorkerError(TorchMPExtError, RuntimeError):
    """A worker of a :class:`~torch_mp_ext.DataLoader` died or hung, and was not replaced.

    The message starts with torch's own words (``DataLoader worker (pid 123) is killed by
    signal: Killed.``, ``DataLoader timed out after 10 seconds``), then says why: the OOM
    killer's counters, a full ``/dev/shm``, the crash stack, or the stack of a hung worker.
    A ``RuntimeError``, as torch's.

    Attributes:
        worker_id: the worker's index (``get_worker_info().id`` in it).
        pid: its pid.
        exit_code: ``Process.exitcode`` (negative: the signal), or None if it hung.
        signal_name: the signal's name (``"SIGKILL"``) when a signal ended it, else None.
        reason: one word, as :class:`ProcessFailure`'s, or ``"hung"``.

    Example:
        ```python
        import os
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.errors import DataLoaderWorkerError

        class Crashing(torch.utils.data.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                if i == 5:
                    os._exit(3)   # a worker dies without a word
                return i

        if __name__ == "__main__":
            try:
                list(mp.DataLoader(Crashing(), batch_size=2, num_workers=2))
            except DataLoaderWorkerError as e:   # torch's sentence, then the cause
                print(e.worker_id, e.exit_code, e.reason)
        ```
    """

    def __init__(self, message: str, *, worker_id: int = 0, pid: int | None = None,
                 exit_code: int | None = None, signal_name: str | None = None,
                 reason: str = "") -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exit_code = exit_code
        self.signal_name = signal_name
        self.reason = reason

    def __reduce__(self) -> tuple:
        return (_rebuild_loader_error, (self.args[0] if self.args else "", self.__dict__))


def _rebuild_loader_error(message: str, state: dict) -> DataLoaderWorkerError:
    err = DataLoaderWorkerError(message)
    err.__dict__.update(state)
    return err


class WorkerRestartWarning(RuntimeWarning):
    """A :class:`~torch_mp_ext.DataLoader` worker died or hung and was replaced
    (``max_worker_restarts``); the message names the cause, and the epoch goes on.

    Example:
        ```python
        import os
        import signal
        import warnings
        import torch
        import torch_mp_ext as mp
        from torch_mp_ext.errors import WorkerRestartWarning

        class DiesOnce(torch.utils.data.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                if i == 5 and not os.path.exists("died"):
                    open("died", "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                return i

        if __name__ == "__main__":
            loader = mp.DataLoader(DiesOnce(), batch_size=2, num_workers=2, max_worker_restarts=1)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                batches = [b.tolist() for b in loader]
            assert batches == [[0, 1], [2, 3], [4, 5], [6, 7]]   # the same epoch
            assert any(issubclass(w.category, WorkerRestartWarning) for w in caught)
        ```
    """


class CudaSharingWarning(RuntimeWarning):
    """A process exits while other processes still use CUDA memory it shared.

    Emitted after the bounded exit wait (``torch_mp_ext.cuda.set_exit_wait``); the message
    counts the blocks and bytes still referenced and names the processes holding them.

    Example:
        ```python
        import warnings
        from torch_mp_ext.errors import CudaSharingWarning

        # A producer that must not exit while its CUDA tensors are in use elsewhere:
        warnings.simplefilter("error", CudaSharingWarning)
        ```
    """


class TorchVersionError(TorchMPExtError, ImportError):
    """The installed torch lacks a private name torch_mp_ext needs (Note [Torch internals] in
    ``torch_internals.py``): raised by ``import torch_mp_ext``, naming it and the torch
    versions torch_mp_ext was tested with.

    Example:
        ```python
        import subprocess
        import sys

        # A torch without one of the names (as a release that renamed it would be):
        code = "import torch._utils; del torch._utils._rebuild_tensor; import torch_mp_ext"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        print(out.stderr.splitlines()[-1])   # torch_mp_ext.errors.TorchVersionError: ...
        assert "TorchVersionError" in out.stderr
        ```
    """


class UntestedTorchWarning(UserWarning):
    """The installed torch is not one torch_mp_ext was tested with, though every private name
    it needs is present (Note [Torch internals] in ``torch_internals.py``).

    Example:
        ```python
        import warnings
        from torch_mp_ext.errors import UntestedTorchWarning

        # Silence it once the test suite passed on your torch:
        warnings.filterwarnings("ignore", category=UntestedTorchWarning)
        import torch_mp_ext  # noqa: F401
        ```
    """


class ForkAfterThreadsWarning(RuntimeWarning):
    """A child is started with the ``fork`` start method while the parent runs other threads
    (Python or native: OpenMP/MKL pools, tokenizers, gRPC), whose locks the child inherits
    held: a child may then hang at random (Note [Fork after threads] in
    ``processes/forkcheck.py``).

    Emitted once per process, naming the threads; silence it with
    ``warnings.filterwarnings("ignore", category=ForkAfterThreadsWarning)``.

    Example:
        ```python
        import threading
        import warnings
        import torch_mp_ext as mp
        from torch_mp_ext.errors import ForkAfterThreadsWarning

        def work():
            pass

        if __name__ == "__main__":
            done = threading.Event()
            threading.Thread(target=done.wait).start()   # a thread runs during the fork
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                p = mp.get_context("fork").Process(target=work)
                p.start()
            done.set()
            p.join(60)
            assert any(issubclass(w.category, ForkAfterThreadsWarning) for w in caught)
        ```
    """


_OSERROR_AS_SHARED_MEMORY = {_errno.ENOSPC, _errno.ENOMEM, _errno.EMFILE, _errno.ENFILE,
                             _errno.EFBIG}


def _with_fd_fix(err: int, message: str) -> str:
    """Adds the cause and the fix to an out-of-fds error that does not name them yet."""
    if err == _errno.EMFILE and "RLIMIT_NOFILE" not in message:
        soft, hard = _resource.getrlimit(_resource.RLIMIT_NOFILE)
        return (f"{message}. This process is at its open-file limit (RLIMIT_NOFILE={soft}, "
                f"hard limit {hard}): raise it (`ulimit -n {max(soft * 4, 65536)}` in the shell "
                "that starts Python, `docker run --ulimit nofile=65536:65536`, or "
                "resource.setrlimit at startup), or close files and sockets sooner")
    if err == _errno.ENFILE:
        return (f"{message}. The system-wide table of open files is full: raise "
                "fs.file-max (sysctl) or stop processes holding many files")
    return message


def oserror(err: int, message: str, resource: str) -> OSError:
    """The exception for a failed system call (used by the C++ core's translator).

    Resource exhaustion becomes :class:`SharedMemoryError`; anything else the ``OSError``
    subclass Python picks for the errno (``FileNotFoundError`` for ENOENT, ...).

    Args:
        err: the ``errno`` value.
        message: what failed, and why.
        resource: the file, segment or queue it failed on (the exception's ``filename``).

    Example:
        ```python
        import errno
        from torch_mp_ext.errors import SharedMemoryError, oserror

        e = oserror(errno.ENOSPC, "ftruncate failed", "/dev/shm/tmx_1_ab")
        assert isinstance(e, SharedMemoryError) and e.errno == errno.ENOSPC
        assert type(oserror(errno.ENOENT, "open failed", "x")) is FileNotFoundError
        ```
    """
    if err in _OSERROR_AS_SHARED_MEMORY:
        return SharedMemoryError(err, _with_fd_fix(err, message), resource)
    return OSError(err, message, resource)


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in another process.

    Args:
        tb: the traceback's text, as ``traceback.format_exception`` writes it.

    Example:
        ```python
        import pickle
        from torch_mp_ext.errors import RemoteTraceback, with_traceback

        try:
            int("x")
        except ValueError as e:
            received = pickle.loads(pickle.dumps(with_traceback(e)))
        assert isinstance(received.__cause__, RemoteTraceback)
        assert 'int("x")' in str(received.__cause__)
        ```
    """

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def _rebuild_exc(exc: BaseException, tb: str) -> BaseException:
    exc.__cause__ = RemoteTraceback(tb)
    return exc


class ExceptionWithTraceback:
    """Pickles an exception together with its formatted traceback.

    Unpickled, it *is* the original exception, with ``__cause__`` set to a
    :class:`RemoteTraceback` holding the remote stack.

    Args:
        exc: the exception.
        tb: its traceback (default: ``exc.__traceback__``).

    Example:
        ```python
        import pickle
        from torch_mp_ext.errors import ExceptionWithTraceback

        try:
            {}["missing"]
        except KeyError as e:
            data = pickle.dumps(ExceptionWithTraceback(e))
        err = pickle.loads(data)   # the KeyError itself, its stack as __cause__
        assert isinstance(err, KeyError) and "missing" in str(err.__cause__)
        ```
    """

    def __init__(self, exc: BaseException, tb: Any = None) -> None:
        if tb is None:
            tb = exc.__traceback__
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        self.exc = exc
        self.tb = f'\n"""\n{text}"""'

    def __reduce__(self) -> tuple:
        return _rebuild_exc, (self.exc, self.tb)


def with_traceback(exc: BaseException) -> ExceptionWithTraceback:
    """Wraps ``exc`` so that it crosses a pickle with its traceback as ``__cause__``.

    Args:
        exc: an exception that was raised (its ``__traceback__`` is formatted).

    Example:
        ```python
        import pickle
        from torch_mp_ext.errors import with_traceback

        try:
            1 / 0
        except ZeroDivisionError as e:
            err = pickle.loads(pickle.dumps(with_traceback(e)))
        assert isinstance(err, ZeroDivisionError) and "1 / 0" in str(err.__cause__)
        ```
    """
    return ExceptionWithTraceback(exc)


@dataclasses.dataclass(frozen=True)
class ProcessFailure:
    """How one process started by :func:`~torch_mp_ext.start_processes` failed.

    Attributes:
        index: the process index (``fn``'s first argument).
        pid: its pid.
        exit_code: ``Process.exitcode``: the exit status, or minus the signal number.
        signal_name: the signal's name (``"SIGSEGV"``) when a signal ended it, else ``None``.
        reason: one word for what happened: ``"raised"``, ``"exit_code"``, ``"oom_kill"``,
            ``"bus_error"``, ``"segfault"``, ``"abort"`` or ``"signal"``.
        summary: one line saying what happened (the exception, or the signal's meaning).

    Example:
        ```python
        import os
        import torch_mp_ext as mp

        def work(rank):
            os._exit(3 + rank)

        if __name__ == "__main__":
            try:
                mp.start_processes(work, nprocs=2, start_method="fork")
            except mp.ProcessExitedException as e:
                for failure in e.failures:   # ProcessFailure: the reported one first
                    print(failure.index, failure.exit_code, failure.reason)
        ```
    """

    index: int
    pid: int | None
    exit_code: int | None
    signal_name: str | None
    reason: str
    summary: str


class ProcessException(_TorchProcessException, TorchMPExtError):
    """A process started by :func:`~torch_mp_ext.start_processes` failed.

    A ``torch.multiprocessing.spawn.ProcessException`` too, with its constructor,
    ``error_index`` and ``error_pid``; ``pid`` is an alias of ``error_pid`` (torch < 1.13's
    name). ``failures`` lists every process that failed, the reported one first.

    Example:
        ```python
        import torch_mp_ext as mp
        from torch_mp_ext.errors import ProcessException

        def work(rank):
            raise RuntimeError(f"rank {rank} failed")

        if __name__ == "__main__":
            try:
                mp.start_processes(work, nprocs=1, start_method="fork")
            except ProcessException as e:   # raised or exited; torch's class too
                assert e.error_index == 0 and e.pid == e.error_pid
        ```
    """

    failures: tuple[ProcessFailure, ...] = ()

    @property
    def pid(self) -> int:
        """The failed process's pid (``error_pid``)."""
        return self.error_pid

    def __reduce__(self) -> tuple:
        cls, args = super().__reduce__()[:2]
        return cls, args, {"failures": self.failures}


class ProcessRaisedException(ProcessException, _TorchProcessRaisedException):
    """A process failed because ``fn`` raised an exception.

    The message is torch's (it ends with the last line of the child's traceback). When the
    child's exception could be pickled it is this exception's ``__cause__``, itself caused
    by a :class:`RemoteTraceback` holding the child's stack.

    Example:
        ```python
        import torch_mp_ext as mp

        def work(rank):
            raise KeyError("weights.pt")

        if __name__ == "__main__":
            try:
                mp.start_processes(work, nprocs=1, start_method="fork")
            except mp.ProcessRaisedException as e:
                assert isinstance(e.__cause__, KeyError)   # the child's exception object
        ```
    """


class ProcessExitedException(ProcessException, _TorchProcessExitedException):
    """A process exited with a non-zero code or was ended by a signal.

    ``exit_code`` is negative for a signal, whose name is ``signal_name``; the message says
    what the signal usually means (an OOM kill, a full ``/dev/shm``, a segfault with the
    child's stack).

    Example:
        ```python
        import os
        import signal
        import torch_mp_ext as mp

        def work(rank):
            os.kill(os.getpid(), signal.SIGTERM)

        if __name__ == "__main__":
            try:
                mp.start_processes(work, nprocs=1, start_method="fork")
            except mp.ProcessExitedException as e:
                assert e.signal_name == "SIGTERM" and e.exit_code == -signal.SIGTERM
        ```
    """
