"""Workers of a ``torch.distributed`` job, on one machine or many: :func:`launch`.

:func:`launch` is a function-call front over ``torch.distributed.elastic``, the engine behind
``torchrun``: its agent starts, watches and restarts the workers, its rendezvous forms the
group, its error files say which rank failed first. Each worker starts with the environment
torchrun gives it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...,
``TORCHELASTIC_*``, ``GROUP_*``, ``ROLE_*``), so it only calls
``torch.distributed.init_process_group("gloo")`` (or ``"nccl"``)::

    def train(local_rank):
        dist.init_process_group("gloo")
        ...

    mp.launch(train, nprocs=4)                       # one machine: a free port on 127.0.0.1
    mp.launch(train, nprocs=2, nnodes=2, node_rank=0,  # rank 0's machine; run the same on
              master_addr="10.0.0.1", master_port=29500)  # the other with node_rank=1
    mp.launch(train, nprocs=2, nnodes="1:4", rdzv_backend="c10d",   # elastic: 1 to 4
              rdzv_endpoint="10.0.0.1:29400", rdzv_id="job7", max_restarts=3)  # machines

Note [launch over torch.distributed.elastic]
Nothing of process management across machines is ours: :func:`launch` maps its arguments
onto ``LaunchConfig`` exactly as ``torchrun`` maps its flags (static rendezvous from
``master_addr``/``master_port``/``node_rank`` by default, ``OMP_NUM_THREADS=1`` with several
workers when unset, run id ``"none"``, no restarts) and calls ``elastic_launch``. What we add
around it:

- ``fn(local_rank, *args, **kwargs)``, torch.multiprocessing's calling convention; lambdas
  and local functions are pickled by value (Note [By-value fallback]);
- ``GLOO_SOCKET_IFNAME`` picked in each worker (Note [Gloo's interface]), and the agent's
  own address (``local_addr``) picked the same way towards the rendezvous, so nobody
  advertises a loopback address to other machines; for the same reason the machine that
  holds a c10d endpoint is told so (``is_host``: torch matches it by host name);
- restarts across machines: torch 2.13 gives the workers of every attempt one store (the
  static rendezvous's, or the c10d rendezvous's shared TCP store), so a restarted group's
  ``init_process_group`` reads the previous attempt's addresses and gloo's full mesh fails
  ("Connection refused"). With c10d and ``max_restarts`` :func:`launch` sets torch's opt-out,
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a store per attempt, hosted by rank 0), unless
  the caller set it; the static rendezvous has none, so it gets a warning;
- the start: with ``start_method="forkserver"`` (the default) the standard library's
  forkserver the agent uses preloads torch and torch_mp_ext, and the workers start in
  parallel (torch's ``TORCH_MP_PARALLEL_START=1``), unless the caller chose otherwise. Our
  own forkserver cannot be used: the agent builds each worker's environment and starts the
  processes in one method (``LocalElasticAgent._start_workers``), with nothing to plug in;
- the caller's process is left as it was: ``OMP_NUM_THREADS``, ``TORCH_MP_PARALLEL_START``
  and the signal handlers the agent installs (SIGTERM, SIGINT, SIGHUP, SIGQUIT: torchrun is
  a process of its own, :func:`launch` is a call) are restored when it returns, and the
  standard library's forkserver, if the agent started it, is stopped (it would outlive the
  call, holding fds the caller opened before it).

The agent watches its workers by polling (every ``monitor_interval`` seconds, 0.1 s as in
torchrun): that is elastic's design, and the price of its restarts and membership changes.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver as _stdlib_forkserver
import os
import pickle
import signal
import socket
import threading
from typing import Any, Callable

import torch

from ..sharing.byvalue import by_value, probe
from .netif import is_loopback, set_gloo_socket_ifname, source_address

__all__ = ["LaunchContext", "free_port", "launch"]

logger = logging.getLogger(__name__)

_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # what elastic's agent takes over
_SIGNALS_VAR = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # elastic_launch sets it in the caller
_SHARED_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torch's opt-out of one store
_PRELOAD = ["torch", "torch_mp_ext"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; another process may take it later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker(payload: Any) -> Any:
    """What each elastic worker runs: ``fn(local_rank, *args, **kwargs)``."""
    fn, args, kwargs = pickle.loads(payload) if isinstance(payload, bytes) else payload
    set_gloo_socket_ifname()
    return fn(int(os.environ["LOCAL_RANK"]), *args, **kwargs)


def _nodes(nnodes: int | str) -> tuple[int, int]:
    """``2`` -> (2, 2); ``"1:4"`` -> (1, 4), as torchrun's ``--nnodes``."""
    try:
        if isinstance(nnodes, str) and ":" in nnodes:
            low, high = (int(n) for n in nnodes.split(":"))
        else:
            low = high = int(nnodes)
    except ValueError:
        low = high = 0
    if not 0 < low <= high:
        raise ValueError(f"nnodes must be a positive integer or 'MIN:MAX' with 0 < MIN <= MAX "
                         f"(as torchrun's --nnodes), got {nnodes!r}")
    return low, high


def _std(value: Any, name: str) -> Any:
    from torch.distributed.elastic.multiprocessing import Std

    if isinstance(value, (Std, dict)):
        return value
    try:
        return Std.from_str(str(int(value) if isinstance(value, bool) else value))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name} must be 0 (none), 1 (stdout), 2 (stderr), 3 (both) or a "
                         f"per-local-rank map such as '0:3,1:0' (as torchrun's --{name}), got "
                         f"{value!r}") from exc


def _rendezvous(nnodes: int | str, node_rank: int, master_addr: str | None,
                master_port: int | None, rdzv_backend: str, rdzv_endpoint: str | None,
                rdzv_conf: dict | None) -> tuple[int, int, str, dict]:
    """(min_nodes, max_nodes, endpoint, rendezvous config), as torchrun derives them."""
    low, high = _nodes(nnodes)
    conf = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        if low != high:
            raise ValueError(f"nnodes={nnodes!r} is a range, which the static rendezvous cannot "
                             "do: use rdzv_backend='c10d' with an rdzv_endpoint")
        if not 0 <= node_rank < high:
            raise ValueError(f"node_rank must be in [0, {high}), got {node_rank}")
        conf["rank"] = node_rank
    if rdzv_endpoint:
        return low, high, rdzv_endpoint, conf
    master_addr = master_addr or os.environ.get("MASTER_ADDR")
    port = master_port or os.environ.get("MASTER_PORT")
    if high > 1 and (master_addr is None or port is None):
        raise ValueError(
            "with nnodes > 1 every machine must agree on the rendezvous: pass master_addr "
            "(rank 0's machine, reachable from the others) and master_port (or set "
            "MASTER_ADDR and MASTER_PORT), or rdzv_endpoint='host:port'")
    master_addr = master_addr or "127.0.0.1"
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    return low, high, f"{host}:{port or free_port(master_addr)}", conf


class _Caller:
    """Saves what the agent changes in the calling process and puts it back."""

    def __init__(self, env: dict[str, str]) -> None:
        self._env = {k: os.environ.get(k) for k in [*env, _SIGNALS_VAR]}
        self._handlers: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for name in _SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._handlers[sig] = signal.getsignal(sig)
        os.environ.update(env)

    def restore(self) -> None:
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)


class LaunchContext:
    """The agent of a :func:`launch` with ``join=False``, running in a thread.

    ``join(timeout)`` returns True once the workers finished (then :attr:`return_values`
    holds theirs), False if they still run after ``timeout``; it raises what the agent
    raised (``ChildFailedError`` when a worker failed and no restart was left).

    Args:
        run: runs the agent and returns ``{global rank: return value}`` (made by
            :func:`launch`).

    Example:
        ```python
        import torch_mp_ext as mp

        def work(local_rank):
            return local_rank * 10

        if __name__ == "__main__":
            ctx = mp.launch(work, nprocs=2, join=False)   # a LaunchContext
            while not ctx.join(timeout=1):
                pass                                     # the parent is free meanwhile
            assert ctx.return_values == {0: 0, 1: 10}
        ```
    """

    def __init__(self, run: Callable[[], dict]) -> None:
        self.return_values: dict[int, Any] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True,
                                         name="torch_mp_ext launch agent")
        self._thread.start()

    def _run(self, run: Callable[[], dict]) -> None:
        try:
            self.return_values = run()
        except BaseException as exc:  # noqa: BLE001  (raised by join() in the caller)
            self._error = exc

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Waits up to ``timeout`` seconds (None: forever) for the agent to finish.

        ``grace_period`` is accepted for :class:`ProcessContext`'s signature; the agent
        ends workers after its own ``shutdown_timeout``.
        """
        del grace_period
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self._error is not None:
            raise self._error
        return True


def launch(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int = 1,
    *,
    nnodes: int | str = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "forkserver",
    kwargs: dict[str, Any] | None = None,
    max_restarts: int = 0,
    rdzv_backend: str = "static",
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "none",
    rdzv_conf: dict[str, Any] | None = None,
    local_addr: str | None = None,
    log_dir: str | None = None,
    redirects: Any = 0,
    tee: Any = 0,
    role: str = "default",
    monitor_interval: float = 0.1,
) -> dict[int, Any] | LaunchContext:
    """Starts this machine's ``nprocs`` workers of a ``torch.distributed`` job, as torchrun.

    Each worker runs ``fn(local_rank, *args, **kwargs)`` with torchrun's environment
    (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``TORCHELASTIC_RUN_ID``,
    ``TORCHELASTIC_RESTART_COUNT``, ...) and ``GLOO_SOCKET_IFNAME`` set to the interface that
    reaches the master when it is on another machine (Note [Gloo's interface]). The workers
    are managed by ``torch.distributed.elastic``'s agent (Note [launch over
    torch.distributed.elastic]): when one fails, the agent stops the others and restarts the
    whole group (every machine's) up to ``max_restarts`` times, then raises.

    Args:
        fn: the entry point (a lambda or local function is pickled by value).
        args: passed to ``fn`` after the local rank.
        nprocs: workers on this machine (torchrun's ``--nproc-per-node``).
        nnodes: machines in the job, or ``"MIN:MAX"`` for an elastic job (with
            ``rdzv_backend="c10d"``).
        node_rank: this machine's index, ``0 <= node_rank < nnodes`` (static rendezvous).
        master_addr: where the static rendezvous listens; default ``$MASTER_ADDR``, else
            ``127.0.0.1`` for a single machine (required with several).
        master_port: its port; default ``$MASTER_PORT``, else a free port for a single
            machine (required with several: every machine must use the same).
        join: wait for the workers and return their results; False: return a
            :class:`LaunchContext` at once, whose agent runs in a thread.
        daemon: must be False (elastic's workers are not daemonic; kept for the signature).
        start_method: ``"forkserver"`` (torch preloaded, parallel start), ``"spawn"`` or
            ``"fork"``.
        kwargs: keyword arguments for ``fn``.
        max_restarts: group restarts before giving up (torchrun's ``--max-restarts``).
        rdzv_backend: ``"static"`` (``master_addr``/``master_port``/``node_rank``) or
            ``"c10d"`` (any machine may join; ``rdzv_endpoint`` required).
        rdzv_endpoint: ``"host:port"`` of the rendezvous (default: from ``master_addr`` and
            ``master_port``).
        rdzv_id: the job's id; every machine of a job passes the same.
        rdzv_conf: the rendezvous's options (torchrun's ``--rdzv-conf``, as a dict).
        local_addr: this machine's address as the others reach it; default: the one it
            sends from towards the rendezvous (torchrun's default, the host name's address,
            is often a loopback one).
        log_dir: where each attempt's per-rank logs and error files go (default: a fresh
            temporary directory).
        redirects: per-rank stdout/stderr into files in ``log_dir``: 0 none, 1 stdout,
            2 stderr, 3 both, or a map such as ``"0:3,1:0"`` (torchrun's ``--redirects``).
        tee: the same, also printed on the console (torchrun's ``--tee``).
        role: the workers' role (``ROLE_NAME``).
        monitor_interval: seconds between the agent's looks at its workers.

    Returns:
        With ``join``: ``{global rank: fn's return value}`` for this machine's workers.
        Otherwise a :class:`LaunchContext`.

    Raises:
        ValueError: a bad ``nprocs``, ``nnodes``, ``node_rank``, ``max_restarts``,
            ``redirects``/``tee`` or ``daemon``, or several machines without a rendezvous
            address.
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a worker failed
            and no restart was left; the message names the first failure, its rank, host
            and traceback (from its error file).

    Example:
        ```python
        import torch.distributed as dist
        import torch_mp_ext as mp

        def train(local_rank):
            dist.init_process_group("gloo")   # MASTER_ADDR, RANK, WORLD_SIZE are set
            assert dist.get_world_size() == 2
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.launch(train, nprocs=2)
        ```
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got nprocs={nprocs}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    if daemon:
        raise ValueError("daemon=True is not possible: torch.distributed.elastic starts "
                         "non-daemonic workers (they may start processes of their own)")
    low, high, endpoint, conf = _rendezvous(nnodes, node_rank, master_addr, master_port,
                                            rdzv_backend, rdzv_endpoint, rdzv_conf)
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if rdzv_backend == "static" and max_restarts > 0 and high > 1:
        logger.warning(
            "launch(max_restarts=%d) with the static rendezvous across %d machines: torch "
            "%s's static rendezvous keeps one store for every attempt, so a restarted group's "
            "init_process_group can read the previous attempt's addresses (\"Connection "
            "refused\" in connectFullMesh). Use rdzv_backend='c10d' (a fresh store per "
            "attempt) for restarts across machines", max_restarts, high, torch.__version__)
    if high > 1:  # Note [Gloo's interface]: the host name may resolve to a loopback address
        host = parse_rendezvous_endpoint(endpoint, default_port=29400)[0]
        src = source_address(host)
        if local_addr is None and src is not None and not is_loopback(src):
            local_addr = src
        if rdzv_backend == "c10d" and src == host:  # torch matches the endpoint by host name
            conf.setdefault("is_host", True)
    logs = DefaultLogsSpecs(log_dir=log_dir, redirects=_std(redirects, "redirects"),
                            tee=_std(tee, "tee"))
    config = LaunchConfig(
        min_nodes=low, max_nodes=high, nproc_per_node=nprocs, run_id=rdzv_id, role=role,
        rdzv_endpoint=endpoint, rdzv_backend=rdzv_backend, rdzv_configs=conf,
        max_restarts=max_restarts, monitor_interval=monitor_interval,
        start_method=start_method, local_addr=local_addr, logs_specs=logs)
    kwargs = dict(kwargs or {})
    payload: Any = (fn, tuple(args), kwargs)
    if start_method != "fork" and probe((fn, *args, *kwargs.values())):
        payload = by_value(payload) or payload
    env = {}
    if nprocs > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default, with its reason: no oversubscription
    if rdzv_backend == "c10d" and max_restarts > 0:
        # Note [launch over torch.distributed.elastic]: a fresh workers' store per attempt
        env[_SHARED_STORE_VAR] = os.environ.get(_SHARED_STORE_VAR, "1")
    if start_method == "forkserver":
        env.setdefault("TORCH_MP_PARALLEL_START", os.environ.get("TORCH_MP_PARALLEL_START", "1"))
        multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)

    def run() -> dict[int, Any]:
        caller = _Caller(env)
        server = _stdlib_forkserver._forkserver
        had_server = server._forkserver_pid is not None
        try:
            return elastic_launch(config, _worker)(payload)
        except ChildFailedError as exc:
            # Its message names the first failed worker, its host and its traceback (from
            # the error file); the agent's frames below would only keep the agent's store,
            # sockets and the workers' pipes open for as long as the exception lives.
            raise exc.with_traceback(None) from None
        finally:
            caller.restore()
            if not had_server and server._forkserver_pid is not None:
                server._stop()  # the agent started it: the caller's process as it was

    if not join:
        return LaunchContext(run)
    return run()
