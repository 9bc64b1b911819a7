"""The fast forkserver: workers forked from a server that has torch (and ``__main__``) imported.

Adapted from CPython 3.11 ``Lib/multiprocessing/forkserver.py`` and ``popen_forkserver.py``;
changes: one server per launching process instead of the standard library's module
singleton; it preloads torch, torch_mp_ext and the launcher's main module (3.11's forkserver
never preloads ``__main__``: gh-126631), unless importing main started threads or CUDA
(Note [Preloading main]); it ends when its launcher dies, killing its workers, even though
the workers are still running (Note [Dying with the launcher]); workers get
``PR_SET_PDEATHSIG(SIGKILL)`` on the server first thing; workers see the launcher's
environment as of ``start()``, as spawn and fork workers do, not the server's.

::

    launcher                         server (torch imported)            worker
    --------                         -----------------------            ------
    connect, send fds ─────────────▶ accept, recvfds, fork ───────────▶ pdeathsig(SIGKILL)
    read pid ◀─────── status pipe ── write pid                          read Process, run it
    write prep data + Process ──────────── data pipe ─────────────────▶ ...
    read exit code ◀── status pipe ── SIGCHLD: waitpid, write code       exit
    (dies) ── EOF on alive pipe ───▶ SIGKILL workers, exit ────────────▶ (pdeathsig)

Note [Dying with the launcher]
The standard library's forkserver exits when every holder of its "alive" pipe is gone, and it
hands that pipe to each worker: a launcher killed with SIGKILL leaves the server and all its
workers running. Here only the launcher holds the write end (fork children of the launcher
close their copy at once), so its death, however it happens, is an EOF the server sees
immediately; the server then SIGKILLs its workers and exits, and a worker that was not yet
known to it dies of its parent-death signal.

Note [Preloading main]
Spawn workers re-run the launcher's main module (as ``__mp_main__``) each; doing it once in
the server saves that per worker, and is what ``forkserver`` users ask for with
``set_forkserver_preload(["__main__"])``. It is unsafe when importing main leaves threads
running or CUDA initialised (a fork would copy a half-held lock, or a CUDA context that does
not survive fork), or when it fails: the server then starts over as a fresh interpreter
without it, and workers import main themselves as they would under the standard forkserver.
The server imports main with the launcher's ``sys.argv``, as a spawn worker does (a script
that reads its arguments at import time would fail on the server's ``-c``); a failure is not
reported there (each worker imports main again and reports it as the standard one would),
an unsafe import is, on stderr (it explains why workers start slower).
"""

from __future__ import annotations

import errno
import io
import os
import secrets
import select
import selectors
import signal
import socket
import sys
import threading
from multiprocessing import forkserver as _stdlib_forkserver
from multiprocessing import popen_forkserver, process, reduction, resource_tracker, spawn, util
from multiprocessing.context import set_spawning_popen
from typing import Any

from .. import _C
from . import payload, popen_spawn
from .process import StrategyCarrier

__all__ = [
    "ForkServerProcess",
    "ensure_running",
    "server_fds",
    "server_pid",
    "set_preload",
    "start_forkserver",
    "stop",
]

_DEFAULT_PRELOAD = ["torch", "torch_mp_ext"]
_MAXFDS_TO_SEND = 256
_IS_LINUX = sys.platform.startswith("linux")

# In a worker: the fds the launcher passed (DupFd indices point here).
_inherited_fds: list[int] = []


def _server_command(listener_fd: int, alive_r: int, preload: list[str], main_spec: dict) -> str:
    return (f"from torch_mp_ext.processes.forkserver import main; "
            f"main({listener_fd}, {alive_r}, {preload!r}, {main_spec!r}, {sys.path!r})")


class _Server:
    """The launcher's handle on its server process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pid: int | None = None
        self.alive_fd: int | None = None
        self.address: str | None = None
        self.preload = list(_DEFAULT_PRELOAD)

    def ensure_running(self) -> int:
        """Starts the server unless it runs; returns its pid."""
        with self._lock:
            if self.pid is not None:
                try:
                    pid, _ = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:
                    pid = self.pid
                if pid == 0:
                    return self.pid
                self._forget()
            return self._start()

    def _start(self) -> int:
        address = os.path.join(util.get_temp_dir(), f"tmx-fs-{os.getpid()}-{secrets.token_hex(4)}")
        data = popen_spawn.preparation_data("ignore")
        main_spec = {k: v for k, v in data.items() if k.startswith("init_main_from_")}
        if main_spec:  # main runs there with the launcher's argv, as in a spawn worker
            main_spec["sys_argv"] = data["sys_argv"]
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            os.chmod(address, 0o600)  # CVE-2022-42919: only this user may ask for a fork
            listener.listen()
            alive_r, alive_w = os.pipe()
            try:
                cmd = _server_command(listener.fileno(), alive_r, self.preload, main_spec)
                exe = spawn.get_executable()
                flags = util._args_from_interpreter_flags()  # type: ignore[attr-defined]
                pid = util.spawnv_passfds(exe, [exe, *flags, "-c", cmd],  # type: ignore[arg-type]
                                          [listener.fileno(), alive_r])
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
        self.pid, self.alive_fd, self.address = pid, alive_w, address
        # At exit, after multiprocessing has joined this process's children (finalizers of
        # negative priority run last), so the server is reaped rather than left a zombie.
        util.Finalize(None, self.stop, exitpriority=-50)
        return pid

    def _forget(self) -> None:
        if self.alive_fd is not None:
            os.close(self.alive_fd)
        if self.address is not None:
            try:
                os.unlink(self.address)
            except OSError:
                pass
        self.pid = self.alive_fd = self.address = None

    def stop(self, timeout: float = 5.0) -> None:
        """Stops the server (it kills its workers) and reaps it; SIGKILL after ``timeout`` s."""
        with self._lock:
            pid = self.pid
            self._forget()
        if pid is not None:
            _reap_within(pid, timeout)

    def after_fork_in_child(self) -> None:
        # Note [Dying with the launcher]: a fork child must not keep the server alive.
        self._lock = threading.Lock()
        if self.alive_fd is not None:
            os.close(self.alive_fd)
        self.pid = self.alive_fd = self.address = None

    def connect_to_new_process(self, fds: list[int]) -> tuple[int, int]:
        """Asks the server for a worker; returns (status fd to read, data fd to write)."""
        self.ensure_running()
        address = self.address
        if len(fds) + 3 >= _MAXFDS_TO_SEND:
            raise ValueError(f"too many fds to pass to a worker ({len(fds)})")
        tracker_fd: int = resource_tracker.getfd()  # type: ignore[assignment]
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(address)  # type: ignore[arg-type]
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            try:
                reduction.sendfds(client, [child_r, child_w, tracker_fd, *fds])
                return parent_r, parent_w
            except BaseException:
                os.close(parent_r)
                os.close(parent_w)
                raise
            finally:
                os.close(child_r)
                os.close(child_w)


_server = _Server()
ensure_running = _server.ensure_running
stop = _server.stop
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_server.after_fork_in_child)


def start_forkserver() -> None:
    """Starts the fast forkserver now, in the background.

    The first ``start_processes(..., start_method="forkserver")`` otherwise waits for the
    server to import torch (about as long as ``import torch`` takes); started early, the
    server does that while this process goes on with its own work.

    Example:
        ```python
        import torch_mp_ext as mp

        def work(rank):
            pass

        if __name__ == "__main__":
            mp.start_forkserver()   # the server imports torch while this process goes on
            mp.start_processes(work, nprocs=2, start_method="forkserver")
        ```
    """
    _server.ensure_running()


def set_preload(module_names: list[str]) -> None:
    """``set_forkserver_preload``: modules the server imports (besides torch and torch_mp_ext;
    ``__main__`` is preloaded where safe anyway, Note [Preloading main]) at its next start."""
    if not all(isinstance(name, str) for name in module_names):
        raise TypeError("module_names must be a list of strings")
    extra = [n for n in module_names if n not in _DEFAULT_PRELOAD and n != "__main__"]
    _server.preload = _DEFAULT_PRELOAD + extra


def server_pid() -> int | None:
    """The running server's pid, or None."""
    return _server.pid


def server_fds() -> list[int]:
    """The fds this process holds for its server (the alive pipe)."""
    return [] if _server.alive_fd is None else [_server.alive_fd]


class _DupFd:
    """An fd passed to a worker: the index of it among the fds sent with the request."""

    def __init__(self, ind: int) -> None:
        self.ind = ind

    def detach(self) -> int:
        return _inherited_fds[self.ind]


class _Popen(payload.GuardedPopen, popen_forkserver.Popen):
    DupFd = _DupFd  # type: ignore[assignment]

    def _launch(self, process_obj: Any) -> None:
        prep_data = popen_spawn.preparation_data(process_obj._name)
        buf = io.BytesIO()

        def dump() -> int:
            set_spawning_popen(self)
            try:
                reduction.dump(prep_data, buf)
                start = buf.tell()
                popen_spawn.dump_process(process_obj, buf)
                return start
            finally:
                set_spawning_popen(None)

        # Note [Unopened payloads] (payload.py)
        self._tmx_launch_guarded(buf, dump, lambda: self._send(buf))

    def _send(self, buf: io.BytesIO) -> None:
        self.sentinel, w = _server.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        # The worker's parent_process().sentinel: a copy of the data pipe's write end.
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds,  # type: ignore[attr-defined]
                                       (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = _stdlib_forkserver.read_signed(self.sentinel)


class ForkServerProcess(StrategyCarrier, process.BaseProcess):
    """A ``forkserver`` Process started by torch_mp_ext's fast server."""

    _start_method = "forkserver"

    def start(self) -> None:
        self._tmx_environ = dict(os.environ)
        super().start()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        environ = state.get("_tmx_environ")
        if environ is not None and environ != os.environ:
            os.environ.clear()
            os.environ.update(environ)

    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:  # noqa: N802 (multiprocessing's name)
        return _Popen(process_obj)


# --- the server process -------------------------------------------------------------------


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _preload_main(main_spec: dict) -> str | None:
    """Imports the launcher's main module here; returns why that was unsafe, or None."""
    threads = _thread_count()
    me: Any = process.current_process()
    me._inheriting = True  # as spawn workers import it
    argv = sys.argv
    sys.argv = list(main_spec.get("sys_argv", argv))  # a script may read it at import
    try:
        if "init_main_from_path" in main_spec:
            spawn.import_main_path(main_spec["init_main_from_path"])
        elif "init_main_from_name" in main_spec:
            spawn._fixup_main_from_name(  # type: ignore[attr-defined]
                main_spec["init_main_from_name"])
    except BaseException as e:  # noqa: BLE001 (SystemExit from a script without a main guard)
        return f"importing it failed ({type(e).__name__}: {e})"
    finally:
        del me._inheriting
        sys.argv = argv
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "importing it initialised CUDA"
    if _thread_count() != threads:
        return "importing it started threads"
    return None


def main(listener_fd: int, alive_r: int, preload: list[str], main_spec: dict,
         sys_path: list[str]) -> None:
    """Runs the server: preloads, then forks a worker per request until the launcher dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the launcher to handle
    sys.path[:] = sys_path
    for name in preload:
        try:
            __import__(name)
        except ImportError:
            pass
    if main_spec:
        why = _preload_main(main_spec)
        if why is not None:  # Note [Preloading main]: start over without it
            if not why.startswith("importing it failed"):  # a failure shows in each worker
                where = main_spec.get("init_main_from_path",
                                      main_spec.get("init_main_from_name"))
                sys.stderr.write(f"torch_mp_ext forkserver: not preloading {where}: {why}; "
                                 "workers import it themselves\n")
                sys.stderr.flush()
            cmd = _server_command(listener_fd, alive_r, preload, {})
            flags = util._args_from_interpreter_flags()  # type: ignore[attr-defined]
            os.execv(sys.executable, [sys.executable, *flags, "-c", cmd])
    _serve(listener_fd, alive_r)


def _close_stdin() -> None:
    if sys.stdin is not None:
        try:
            sys.stdin.close()
        except (OSError, ValueError):
            pass
    sys.stdin = open(os.devnull)  # noqa: SIM115 (the process's stdin for good)


def _serve(listener_fd: int, alive_r: int) -> None:
    _close_stdin()
    # Note [Session names]: the server holds no handles and lives until its launcher has
    # exited, so it must not count as a live member of the run; each worker joins at fork.
    _C.session_leave()
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    handlers: dict[int, Any] = {signal.SIGCHLD: lambda *_: None, signal.SIGINT: signal.SIG_IGN}
    old_handlers = {sig: signal.signal(sig, val) for sig, val in handlers.items()}
    # main() ignored SIGINT already; workers get Python's own handler back, as spawn workers.
    old_handlers[signal.SIGINT] = signal.default_int_handler
    signal.set_wakeup_fd(sig_w)  # os.write in a Python signal handler would be racy
    pid_to_fd: dict[int, int] = {}
    server = os.getpid()
    with socket.socket(socket.AF_UNIX, fileno=listener_fd) as listener, \
            selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(alive_r, selectors.EVENT_READ)
        selector.register(sig_r, selectors.EVENT_READ)
        while True:
            try:
                ready = [key.fileobj for key, _ in selector.select()]
                if alive_r in ready:  # Note [Dying with the launcher]
                    for pid in pid_to_fd:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    for pid in pid_to_fd:  # reaped here: an orphaned zombie may never be
                        _reap_within(pid, 2.0)
                    return
                if sig_r in ready:
                    _reap(sig_r, pid_to_fd)
                if listener in ready:
                    with listener.accept()[0] as conn:
                        fds = reduction.recvfds(conn, _MAXFDS_TO_SEND + 1)
                    if len(fds) > _MAXFDS_TO_SEND:
                        raise RuntimeError(f"too many ({len(fds)}) fds to receive")
                    child_r, child_w, *fds = fds
                    pid = os.fork()
                    if pid == 0:
                        code = 1
                        try:
                            listener.close()
                            selector.close()
                            unused = [alive_r, child_w, sig_r, sig_w, *pid_to_fd.values()]
                            code = _serve_one(child_r, fds, unused, old_handlers, server)
                        except Exception:  # noqa: BLE001  (printed, then exit code 1)
                            sys.excepthook(*sys.exc_info())
                            sys.stderr.flush()
                        finally:
                            os._exit(code)
                    try:
                        _stdlib_forkserver.write_signed(child_w, pid)
                    except BrokenPipeError:
                        pass  # the launcher gave up on this worker
                    pid_to_fd[pid] = child_w
                    os.close(child_r)
                    for fd in fds:
                        os.close(fd)
            except OSError as e:
                if e.errno != errno.ECONNABORTED:
                    raise


def _reap_within(pid: int, timeout: float) -> None:
    """Waits for child ``pid`` to exit, SIGKILLing it after ``timeout`` seconds."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        pidfd = -1  # reaped already
    try:
        if pidfd >= 0 and not select.select([pidfd], [], [], timeout)[0]:  # sleeps, no poll
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _reap(sig_r: int, pid_to_fd: dict[int, int]) -> None:
    os.read(sig_r, 65536)
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        child_w = pid_to_fd.pop(pid, None)
        if child_w is not None:
            try:
                _stdlib_forkserver.write_signed(child_w, os.waitstatus_to_exitcode(status))
            except BrokenPipeError:
                pass
            os.close(child_w)


def _serve_one(child_r: int, fds: list[int], unused: list[int], handlers: dict,
               server: int) -> int:
    """In a fresh worker: tie it to the server, then run the Process object sent to it."""
    global _inherited_fds
    if _IS_LINUX:
        _C.set_pdeathsig(signal.SIGKILL)
        if os.getppid() != server:  # the server died before prctl: nobody to serve
            return 1
    signal.set_wakeup_fd(-1)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    for fd in unused:
        os.close(fd)
    tracker_fd, *_inherited_fds = fds
    # The launcher's resource tracker, as the standard library's forkserver does.
    resource_tracker._resource_tracker._fd = tracker_fd  # type: ignore[attr-defined]
    parent_sentinel = os.dup(child_r)
    return spawn._main(child_r, parent_sentinel)
