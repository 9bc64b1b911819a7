"""Local workers ready for ``torch.distributed``: :func:`launch`.

Each worker starts with the environment ``init_process_group()``'s default ``env://``
rendezvous reads, as ``torchrun`` sets it, so the worker only calls
``torch.distributed.init_process_group("gloo")`` (or ``"nccl"``)::

    def train(local_rank):
        dist.init_process_group("gloo")
        ...

    mp.launch(train, nprocs=4)                       # one machine: a free port on 127.0.0.1
    mp.launch(train, nprocs=8, nnodes=2, node_rank=0,  # rank 0's machine; run the same on
              master_addr="10.0.0.1", master_port=29500)  # the other with node_rank=1
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

from .spawn import ProcessContext, start_processes

__all__ = ["free_port", "launch"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; another process may take it later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _run_with_env(local_rank: int, fn: Callable[..., Any], env: dict[str, str],
                  nprocs: int, node_rank: int, args: tuple) -> None:
    os.environ.update(env)
    os.environ.update({
        "RANK": str(node_rank * nprocs + local_rank),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(node_rank),
    })
    fn(local_rank, *args)


def launch(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int = 1,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "forkserver",
) -> ProcessContext | None:
    """Starts ``nprocs`` workers of a ``torch.distributed`` job on this machine.

    Each runs ``fn(local_rank, *args)`` with ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``
    (``node_rank * nprocs + local_rank``), ``LOCAL_RANK``, ``WORLD_SIZE``
    (``nnodes * nprocs``), ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` (``node_rank``) set, as
    ``torchrun`` sets them. Failures are handled as by :func:`start_processes`.

    Args:
        fn: the entry point, defined at the top level of a module.
        args: passed to ``fn`` after the local rank.
        nprocs: workers on this machine.
        nnodes: machines in the job, each running ``launch`` with its own ``node_rank``.
        node_rank: this machine's index, ``0 <= node_rank < nnodes``.
        master_addr: where rank 0 listens; default ``$MASTER_ADDR``, else ``127.0.0.1`` for a
            single machine (required with several).
        master_port: its port; default ``$MASTER_PORT``, else a free port for a single
            machine (required with several: every machine must use the same).
        join: join the workers before returning.
        daemon: the workers' daemon flag.
        start_method: ``"forkserver"`` (fast: torch already imported), ``"spawn"`` or
            ``"fork"``.

    Returns:
        None if ``join``, else the :class:`ProcessContext` to join.

    Raises:
        ValueError: a bad ``nprocs``, ``nnodes`` or ``node_rank``, or several machines without
            ``master_addr``/``master_port``.

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
    if nprocs < 1 or nnodes < 1:
        raise ValueError(f"nprocs and nnodes must be >= 1, got nprocs={nprocs}, nnodes={nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, {nnodes}), got {node_rank}")
    master_addr = master_addr or os.environ.get("MASTER_ADDR")
    port = master_port or os.environ.get("MASTER_PORT")
    if nnodes > 1 and (master_addr is None or port is None):
        raise ValueError(
            "with nnodes > 1 every machine must agree on the rendezvous: pass master_addr "
            "(rank 0's machine, reachable from the others) and master_port (or set "
            "MASTER_ADDR and MASTER_PORT)")
    master_addr = master_addr or "127.0.0.1"
    env = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port or free_port(master_addr)),
        "WORLD_SIZE": str(nnodes * nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
    }
    return start_processes(_run_with_env, (fn, env, nprocs, node_rank, args), nprocs, join,
                           daemon, start_method)
