"""Starting a spawn child, also from a script read from stdin.

Adapted from CPython 3.11 ``Lib/multiprocessing/popen_spawn_posix.py`` (``Popen._launch``);
changes: the preparation data comes from :func:`preparation_data`, which leaves out a main
module path that does not exist; the process object is pickled by :func:`dump_process`,
which falls back to pickling what it runs by value.

Note [A main module read from stdin]
``python - < script.py`` (or ``python < script.py``) runs ``__main__`` with ``__file__`` set
to ``"<stdin>"``. The standard library's spawn and forkserver children take that for a path
and run ``runpy.run_path("<cwd>/<stdin>")`` before anything else, which fails: every child of
such a script dies at start (with stock torch.multiprocessing too). Our children are told
about main only when its path exists; such a ``__main__`` is then like ``python -c``'s, which
children cannot import, and its functions and classes are pickled by value (Note [By-value
fallback] in ``sharing/byvalue.py``).
"""

from __future__ import annotations

import io
import os
from multiprocessing import popen_spawn_posix, reduction, resource_tracker, spawn, util
from multiprocessing.context import set_spawning_popen
from typing import Any

from ..sharing import byvalue
from . import payload

__all__ = ["Popen", "dump_process", "preparation_data"]


def dump_process(process_obj: Any, fp: io.BytesIO) -> None:
    """``reduction.dump(process_obj, fp)``, made again with what the process runs pickled by
    value when plain pickling raised, or named a ``__main__`` children cannot import (Note
    [By-value fallback] in ``sharing/byvalue.py``; ``StrategyCarrier.__getstate__`` makes
    the by-value pickle)."""
    start = fp.tell()
    first: Any = None
    try:
        reduction.dump(process_obj, fp)
    except byvalue.BY_REFERENCE_ERRORS as exc:
        first = exc
    else:
        if byvalue.main_is_importable() or not byvalue.names_main(fp.getvalue()[start:]):
            return
        first = True
    fp.seek(start)
    fp.truncate()
    process_obj._tmx_by_value = first  # read (and left out) by StrategyCarrier.__getstate__
    try:
        reduction.dump(process_obj, fp)
    finally:
        del process_obj._tmx_by_value


def preparation_data(name: str) -> dict[str, Any]:
    """``multiprocessing.spawn.get_preparation_data(name)``, less a main path that does not
    exist (Note [A main module read from stdin])."""
    data: dict[str, Any] = spawn.get_preparation_data(name)
    path = data.get("init_main_from_path")
    if path is not None and not os.path.exists(path):
        del data["init_main_from_path"]
    return data


class Popen(payload.GuardedPopen, popen_spawn_posix.Popen):
    """The standard library's spawn ``Popen`` with :func:`preparation_data`, whose payload is
    given back if the child dies before opening it (Note [Unopened payloads] in
    ``payload.py``)."""

    def _launch(self, process_obj: Any) -> None:
        tracker_fd: int = resource_tracker.getfd()  # type: ignore[assignment]
        self._fds.append(tracker_fd)
        prep_data = preparation_data(process_obj._name)
        fp = io.BytesIO()

        def dump() -> int:
            set_spawning_popen(self)
            try:
                reduction.dump(prep_data, fp)
                start = fp.tell()
                dump_process(process_obj, fp)
                return start
            finally:
                set_spawning_popen(None)

        self._tmx_launch_guarded(fp, dump, lambda: self._send(fp, tracker_fd))

    def _send(self, fp: io.BytesIO, tracker_fd: int) -> None:
        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            self._fds.extend([child_r, child_w])
            self.pid = util.spawnv_passfds(spawn.get_executable(),  # type: ignore[arg-type]
                                           cmd, self._fds)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            self.finalizer = util.Finalize(  # type: ignore[attr-defined]
                self, util.close_fds,  # type: ignore[attr-defined]
                [fd for fd in (parent_r, parent_w) if fd is not None])
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)
