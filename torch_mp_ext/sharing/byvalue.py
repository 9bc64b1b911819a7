"""Functions and classes pickled by value where a child could not find them by reference.

Note [By-value fallback]
``pickle`` sends a function or a class as its module and qualified name, for the receiver to
import. That fails for a lambda, a function or class defined inside a function ("Can't pickle
local object"), and, in the receiver, for anything defined in a ``__main__`` that a spawn or
forkserver child cannot import (``python -c``, a script read from stdin, a notebook: "Can't get
attribute 'X' on <module '__main__'>"). Under fork all of these work, because nothing is
pickled; Python 3.14 made forkserver the default on Linux, and such code broke.

torch_mp_ext pickles such objects by value (their code, closure, the globals they use; a class
with its methods) with cloudpickle, as loky and Ray do, but only where plain pickling cannot
do: the fast paths pickle exactly as before and pay nothing (Note [Pickling queue items] in
``pickling.py``). Two cases go by value:

1. plain pickling raised one of :data:`BY_REFERENCE_ERRORS` (a local object, a lambda, a class
   that is not the module attribute its name says): the object is pickled again, by value;
2. plain pickling succeeded, but ``__main__`` cannot be imported by a child
   (:func:`main_is_importable`) and the pickle names it (:func:`names_main`; a scan for the
   bytes ``__main__``, made only in that case): the plain pickle is dropped (its references
   released, Note [Releasing dropped frames]) and the object pickled by value.

Starting a spawn or forkserver process pickles it as before (``popen_spawn.dump_process``),
except that :func:`probe` first looks at the target and its top-level arguments, so that the
usual by-value cases (a lambda target, a local function for ``spawn``, a DataLoader's lambda
``collate_fn`` or local dataset class) go by value at once and never make a first attempt
that fails half-way; deeper ones (a pipeline stage inside its task) are found by cases 1 and
2 and the process object is pickled again.
What such a failed attempt already reduced cannot be taken back: a tensor or queue pickled
before the object that failed keeps the reference its handle carries until its owner exits,
as after any pickling error (its pickle is lost inside the pickler).

Where: every queue item and task value (``pickling.dump_item``: queues, ``Pool``'s tasks and
results, ``TaskPool``, pipeline links); what a spawn or forkserver ``Process`` runs (target,
args, kwargs, by value as one pickle made in ``StrategyCarrier.__getstate__``:
``spawn``/``start_processes``, pipeline stages, DataLoader workers' dataset,
``collate_fn`` and ``worker_init_fn``);
``spawn``'s return values; and ``concurrent.futures.ProcessPoolExecutor``'s work items
(:func:`reduce_call_item`, registered with ``ForkingPickler``: its queue pickles them in a
feeder thread, so only the probe's cases go by value there).

Loading needs nothing of ours: a by-value pickle is a plain pickle that names cloudpickle's
rebuild functions, which the receiver imports. A class pickled by value keeps its identity
across pickles (cloudpickle tracks it by id), so instances sent back are of the same class.

The fallback is on unless ``TORCH_MP_EXT_PICKLE_BY_VALUE=0`` or
``set_pickle_by_value(False)``; without cloudpickle, the error of case 1 says what to install,
and case 2 keeps the plain pickle (the standard library's behaviour).
"""

from __future__ import annotations

import copyreg
import functools
import io
import os
import pickle
import sys
import types
from collections import ChainMap
from concurrent.futures.process import _CallItem
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterable, Optional

__all__ = [
    "BY_REFERENCE_ERRORS",
    "CALL_ITEM",
    "ENV_VAR",
    "by_value",
    "get_pickle_by_value",
    "main_is_importable",
    "names_main",
    "probe",
    "rebuild_call_item",
    "reduce_call_item",
    "set_pickle_by_value",
]

#: The environment variable behind :func:`set_pickle_by_value` (``0`` turns it off).
ENV_VAR = "TORCH_MP_EXT_PICKLE_BY_VALUE"
#: What plain pickling raises for an object it cannot pickle by reference.
BY_REFERENCE_ERRORS = (pickle.PicklingError, AttributeError)
PROTOCOL = 5
_MAIN = b"__main__"
_INSTALL = "pip install cloudpickle (or torch_mp_ext[byvalue])"

_enabled = os.environ.get(ENV_VAR, "1") != "0"
_pickler: Any = None


def get_pickle_by_value() -> bool:
    """Whether objects that cannot be pickled by reference are pickled by value
    (Note [By-value fallback]); ``TORCH_MP_EXT_PICKLE_BY_VALUE=0`` starts with False.

    Example:
        ```python
        import torch_mp_ext as mp

        assert mp.get_pickle_by_value() is True   # unless TORCH_MP_EXT_PICKLE_BY_VALUE=0
        ```
    """
    return _enabled


def set_pickle_by_value(enabled: bool) -> None:
    """Turns the by-value fallback on or off, in this process and in children started after.

    Args:
        enabled: False pickles as the standard library does: a local function, a lambda or
            an object of an unimportable ``__main__`` raises or fails in the child.

    Raises:
        TypeError: ``enabled`` is not a bool.

    Example:
        ```python
        import torch_mp_ext as mp

        mp.set_pickle_by_value(False)   # lambdas sent to spawn children fail, as in the stdlib
        assert mp.get_pickle_by_value() is False
        ```
    """
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _enabled = enabled
    os.environ[ENV_VAR] = "1" if enabled else "0"  # spawn and forkserver children follow


_main_seen: Any = None
_main_importable = True


def main_is_importable() -> bool:
    """Whether a spawn or forkserver child can import this process's ``__main__`` (it has a
    file or a module name; not under ``python -c``, stdin or a notebook: Note [A main module
    read from stdin] in ``processes/popen_spawn.py``)."""
    global _main_seen, _main_importable
    main = sys.modules.get("__main__")
    if main is not _main_seen:  # cached per main module: one identity check per call
        spec = getattr(main, "__spec__", None)
        path = getattr(main, "__file__", None)  # "<stdin>" for a script read from stdin
        _main_importable = getattr(spec, "name", None) is not None or (
            isinstance(path, str) and os.path.exists(path))
        _main_seen = main
    return _main_importable


def names_main(data: Any) -> bool:
    """Case 2 of Note [By-value fallback]: ``data`` (a pickle, or its chunks) names
    ``__main__``, which children cannot import, and the fallback is on."""
    if _main_importable and sys.modules.get("__main__") is _main_seen:  # the fast path
        return False
    if not _enabled or main_is_importable():
        return False
    if type(data) is bytes:
        return _MAIN in data
    # Globals are named in the pickler's own buffer writes, always bytes.
    return any(type(part) is bytes and _MAIN in part for part in data)


def _needs_value(obj: Any) -> bool:
    if isinstance(obj, (types.FunctionType, type)):
        target = obj
    elif isinstance(obj, functools.partial):
        target = obj.func
    elif isinstance(obj, types.MethodType):
        target = obj.__func__
    else:
        target = type(obj)
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return False  # plain pickling decides
    if "<locals>" in qualname or "<lambda>" in qualname:
        return True
    return module == "__main__" and not main_is_importable()


def probe(objects: Iterable[Any]) -> bool:
    """True if one of ``objects`` (or of the tuples and lists among them, one level down) is a
    function or class, or an instance of a class, that a child could not find by reference.

    Cheap (no pickling): lets a process start go by value at once (Note [By-value fallback]).
    """
    if not _enabled:
        return False
    for obj in objects:
        if type(obj) in (tuple, list):
            if any(_needs_value(x) for x in obj):
                return True
        elif _needs_value(obj):
            return True
    return False


def _pickler_class() -> Any:
    global _pickler
    if _pickler is None:
        import cloudpickle

        class ByValuePickler(cloudpickle.Pickler):  # type: ignore[misc,name-defined]
            # torch_mp_ext's and multiprocessing's reducers (tensors as handles, fds as DupFd)
            # before cloudpickle's, as in plain pickling (``pickling._QueuePickler``).
            dispatch_table = ChainMap(
                ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
                cloudpickle.Pickler._dispatch_table,
                copyreg.dispatch_table,  # type: ignore[arg-type]
            )

        _pickler = ByValuePickler
    return _pickler


def _describe(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None)
    if isinstance(name, str) and isinstance(obj, (types.FunctionType, type)):
        return f"{type(obj).__name__} {getattr(obj, '__module__', '?')}.{name}"
    return f"an object of type {type(obj).__module__}.{type(obj).__qualname__}"


def _explain(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(note)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]} ({note})",) + error.args[1:]


def by_value(obj: Any, error: Optional[BaseException] = None) -> Optional[bytes]:
    """``obj`` pickled with its functions and classes by value (Note [By-value fallback]).

    Args:
        obj: what to pickle.
        error: what plain pickling raised (case 1), or None if it succeeded (case 2).

    Returns:
        The pickle; None in case 2 when the fallback is off, cloudpickle is missing or
        by-value pickling failed too (the plain pickle stands, as in the standard library).

    Raises:
        BaseException: ``error`` itself (case 1) when ``obj`` cannot be pickled by value
            either, with a note naming the object and why (the by-value error as the cause).
    """
    if not _enabled:
        if error is None:
            return None
        _explain(error, f"while pickling {_describe(obj)}; pickling by value is off "
                        f"({ENV_VAR}=0 or set_pickle_by_value(False)); define it at the top "
                        "level of an importable module, or turn pickling by value on")
        raise error
    try:
        pickler = _pickler_class()
    except ImportError as missing:
        if error is None:
            return None
        _explain(error, f"while pickling {_describe(obj)}; torch_mp_ext pickles such objects "
                        f"by value with cloudpickle, which is not installed: {_INSTALL}")
        raise error from missing
    buf = io.BytesIO()
    try:
        pickler(buf, PROTOCOL).dump(obj)
    except Exception as again:  # reported with the plain error, or the plain pickle stands
        if error is None:
            return None
        _explain(error, f"while pickling {_describe(obj)}; pickling it by value (cloudpickle) "
                        f"failed too: {type(again).__name__}: {again}")
        raise error from again
    return buf.getvalue()


#: ``concurrent.futures.ProcessPoolExecutor``'s work item (fn, args, kwargs), which its queue
#: pickles in a feeder thread with ``ForkingPickler``: registered there by ``init_reductions``.
CALL_ITEM: Any = _CallItem


def reduce_call_item(item: Any) -> tuple:
    """A work item, by value when :func:`probe` says its function or an argument must be."""
    if probe((item.fn, *item.args, *item.kwargs.values())):
        data = by_value((item.fn, item.args, item.kwargs))
        if data is not None:
            return (rebuild_call_item, (item.work_id, data))
    return (CALL_ITEM, (item.work_id, item.fn, item.args, item.kwargs))


def rebuild_call_item(work_id: int, data: bytes) -> Any:
    fn, args, kwargs = pickle.loads(data)
    return CALL_ITEM(work_id, fn, args, kwargs)
