"""What runs in each worker before ``fn``, and the error file it leaves when ``fn`` raises.

Adapted from ``wrap`` in torch/multiprocessing/spawn.py (torch 2.13); changes: the
parent-death signal is SIGKILL, and a parent that died first is noticed (Note [Children die
with their parent]); ``faulthandler`` writes a native crash's stack next to the error file;
the error file holds the exception object (pickled with its traceback, loky's pattern) as well
as torch's traceback text, and is written atomically; ``fn`` gets keyword arguments too, and
its return value is kept in a result file when asked (Note [Return values]).

Note [Return values]
``spawn(..., return_values=True)`` (and ``start_processes``) keeps what ``fn`` returned in a
file beside the error file, ``<index>.pickle.result``, written atomically after ``fn`` returns;
``ProcessContext.join`` reads them all once every process has exited successfully
(``ProcessContext.results``), then removes them with the error files. The value is pickled
as a plain pickle (tensors by value, since the worker has exited by the time the parent reads
it), by value where it cannot be by reference (Note [By-value fallback] in
``sharing/byvalue.py``). A value that cannot be pickled fails the worker as ``fn`` raising
would. Not asked, nothing is written, and ``fn``'s value is dropped as in torch.

Note [Children die with their parent]
torch's children ask for SIGINT when their parent dies, which a child can catch (torch's own
``wrap`` turns it into a clean exit) or not see while stuck in native code. Ours ask for
SIGKILL, which always works, and check right after asking that the parent did not die before
(the window of a spawn child's start-up). The kernel sends that signal when the *thread* that
started the child ends, so children started from any thread but the main one (a short-lived
thread calling ``start_processes(join=False)``) do not ask for it: they watch their parent
*process* instead, from a native thread waiting on its pidfd (``how == "process"``), which
needs no GIL and so works while the child is stuck in native code. Through the forkserver the
parent is the server, which dies with its launcher (Note [Dying with the launcher] in
``forkserver.py``). Grandchildren started the same way die with their parent in turn.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import sys
import traceback
from typing import Any, Callable

from .. import _C
from ..errors import with_traceback
from ..sharing import byvalue

__all__ = ["FAULT_SUFFIX", "RESULT_SUFFIX", "read_error_file", "read_result_file",
           "remove_files"]

FAULT_SUFFIX = ".faulthandler"
RESULT_SUFFIX = ".result"  # Note [Return values]
_ERROR_FORMAT = "torch_mp_ext-error-1"
_IS_LINUX = sys.platform.startswith("linux")


def die_with_parent(parent: tuple[str, int | None]) -> None:
    """Note [Children die with their parent]."""
    how, expected_ppid = parent
    if _IS_LINUX and how != "process":
        _C.set_pdeathsig(signal.SIGKILL)
    if expected_ppid is not None and os.getppid() != expected_ppid:
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "process" and expected_ppid is not None and _IS_LINUX:
        _C.kill_self_when_process_exits(expected_ppid)


def _write_error_file(path: str, exc: Exception) -> None:
    text = traceback.format_exc()
    try:
        payload: bytes | None = pickle.dumps(with_traceback(exc))
    except Exception:  # noqa: BLE001 (unpicklable: the text alone travels, as in torch)
        payload = None
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as fh:
        pickle.dump((_ERROR_FORMAT, text, payload), fh)
    os.replace(tmp, path)  # the parent never reads half a file


def _write_result_file(path: str, value: Any) -> None:
    """Note [Return values]."""
    try:
        payload = pickle.dumps(value, byvalue.PROTOCOL)
    except byvalue.BY_REFERENCE_ERRORS as exc:
        payload = byvalue.by_value(value, exc)  # type: ignore[assignment]  # or raises
    except Exception as exc:
        if hasattr(exc, "add_note"):
            exc.add_note(f"while pickling the value fn returned (a {type(value).__qualname__}) "
                         "for return_values=True: return something picklable")
        raise
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(payload)
    os.replace(tmp, path)


def read_result_file(path: str) -> Any:
    """The value a worker's ``fn`` returned (Note [Return values]); None if it left none."""
    try:
        with open(path, "rb") as fh:
            return pickle.load(fh)
    except FileNotFoundError:
        return None


def wrap(fn: Callable[..., Any], i: int, args: tuple, error_file: str,
         parent: tuple[str, int | None] = ("pdeathsig", None),
         kwargs: dict[str, Any] | None = None, keep_result: bool = False) -> None:
    die_with_parent(parent)
    try:
        # Kept open until exit: a crash while the interpreter shuts down is reported too.
        fault_file = open(error_file + FAULT_SUFFIX, "w")  # noqa: SIM115
    except OSError:
        pass
    else:
        import faulthandler

        faulthandler.enable(file=fault_file, all_threads=True)
    try:
        value = fn(i, *args, **(kwargs or {}))
        if keep_result:
            _write_result_file(error_file + RESULT_SUFFIX, value)
    except KeyboardInterrupt:
        pass  # SIGINT (Ctrl-C reaches the whole process group): exit quietly, as torch does
    except Exception as e:  # noqa: BLE001  (reported through the error file)
        # Propagate the exception (and its text) to the parent through a file, as torch
        # does: a queue could deadlock.
        _write_error_file(error_file, e)
        sys.exit(1)


def read_error_file(path: str) -> tuple[str, BaseException | None] | None:
    """(traceback text, the child's exception if it unpickles) from an error file, or None."""
    try:
        with open(path, "rb") as fh:
            data = pickle.load(fh)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001
        return f"(the error file {path} could not be read: {e!r})\n", None
    if isinstance(data, str):  # written by torch's own wrap
        return data, None
    _, text, payload = data
    exc = None
    if payload is not None:
        try:
            exc = pickle.loads(payload)
        except Exception:  # noqa: BLE001 (e.g. its class does not import here: text only)
            exc = None
    return text, exc


def remove_files(error_files: list[str], directory: str | None) -> None:
    for path in error_files:
        for name in (path, path + FAULT_SUFFIX, path + RESULT_SUFFIX):
            try:
                os.unlink(name)
            except OSError:
                pass
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
