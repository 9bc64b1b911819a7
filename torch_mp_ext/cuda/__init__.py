"""CUDA tensors across processes: collecting shared blocks, and the producer's exit wait.

A CUDA tensor put on a queue, sent through a pipe or passed to a process travels as torch's
IPC handle of its allocation plus a keep-alive slot in one of torch_mp_ext's counter files
(Note [CUDA lifetimes] in ``torch_mp_ext/cuda/ipc.py``; ``docs/cuda.md``). The producer keeps
each sent block until every process that received it has dropped it (or died); a received
tensor can be sent on to a third process. Collection runs by itself; :func:`ipc_collect` runs
it now. A producer that exits while its blocks are still used waits a bounded time for them
(:func:`set_exit_wait`), then warns (:class:`~torch_mp_ext.errors.CudaSharingWarning`).

Example:
    ```python
    import torch
    import torch_mp_ext as mp

    def consumer(q):
        t = q.get(timeout=60)   # the producer's GPU memory, by CUDA IPC: no copy
        t += 1
        del t                   # released: the producer may free the block

    if __name__ == "__main__":
        if torch.cuda.is_available():
            ctx = mp.get_context("spawn")   # CUDA needs spawn or forkserver children
            q = ctx.Queue()
            p = ctx.Process(target=consumer, args=(q,))
            p.start()
            t = torch.zeros(4, device="cuda")
            q.put(t)
            p.join(60)
            assert t.eq(1).all()
        print(mp.cuda.ipc_stats())
    ```
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import ipc as _cuda_ipc

__all__ = ["ExitWait", "get_exit_wait", "ipc_collect", "ipc_stats", "set_exit_wait"]


def ipc_collect() -> int:
    """Frees the CUDA blocks this process shared that no other process uses any more.

    Also reclaims the keep-alives of receivers that died without releasing (SIGKILL), drops
    counter files whose slots are all back, and calls ``torch.cuda.ipc_collect()`` when CUDA
    is initialised, so one call does what torch's does and ours.

    Returns:
        The number of shared blocks released by this call.

    Example:
        ```python
        import torch_mp_ext as mp

        released = mp.cuda.ipc_collect()   # 0 without CUDA sends
        assert released >= 0
        ```
    """
    released = _cuda_ipc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.ipc_collect()
    return released


class ExitWait(NamedTuple):
    """How long an exiting process waits for receivers of the CUDA blocks it shared.

    Attributes:
        seconds: the whole wait (``None``: until every receiver released).
        unreceived: the part of it spent on blocks no process has received yet, i.e.
            messages still in a queue or pipe (``None``: as long as ``seconds``). A message
            nobody will ever get (an abandoned queue) then holds an exit for this long only.

    Example:
        ```python
        import torch_mp_ext as mp

        wait = mp.cuda.get_exit_wait()
        assert isinstance(wait, mp.cuda.ExitWait) and wait.seconds == 10.0
        ```
    """

    seconds: float | None
    unreceived: float | None


def get_exit_wait() -> ExitWait:
    """The current exit wait. Defaults: ``TORCH_MP_EXT_CUDA_EXIT_WAIT_S`` or 10 s, and
    ``TORCH_MP_EXT_CUDA_EXIT_WAIT_UNRECEIVED_S`` or 2 s.

    Example:
        ```python
        import torch_mp_ext as mp

        seconds, unreceived = mp.cuda.get_exit_wait()
        assert (seconds, unreceived) == (10.0, 2.0)   # unless set by the environment
        ```
    """
    return ExitWait(*_cuda_ipc.get_exit_wait())


def set_exit_wait(seconds: float | None, unreceived: float | None = 2.0) -> None:
    """Sets how long this process waits at exit for receivers of its CUDA blocks.

    After the wait, blocks still in use are reported with a
    :class:`~torch_mp_ext.errors.CudaSharingWarning` naming their count, bytes and holders;
    their memory goes with the process. ``0`` warns at once, ``None`` waits as long as it
    takes (a receiver that never releases then keeps the producer alive).

    Args:
        seconds: the whole wait, in seconds ``>= 0``, or ``None``.
        unreceived: the most of it spent on blocks not received by any process yet
            (see :class:`ExitWait`), or ``None``.

    Raises:
        ValueError: a value is negative or not a number.

    Example:
        ```python
        import torch_mp_ext as mp

        mp.cuda.set_exit_wait(30.0, unreceived=1.0)   # a producer waits up to 30 s at exit
        assert mp.cuda.get_exit_wait() == (30.0, 1.0)
        ```
    """
    _cuda_ipc.set_exit_wait(seconds, unreceived)


def ipc_stats() -> dict[str, int]:
    """What this process shares and holds, for diagnostics.

    Returns:
        ``lent_blocks``/``lent_bytes``: sends other processes may still use;
        ``forwarded_blocks``: received blocks sent on, not yet released by their receiver;
        ``counter_files``: keep-alive files this process owns; ``released_blocks`` and
        ``reclaimed_slots``: totals so far (slots reclaimed from dead receivers);
        ``received_storages``/``held_slots``: blocks of other processes used here;
        ``mapped_counter_files``: other processes' keep-alive files mapped here.

    Example:
        ```python
        import torch_mp_ext as mp

        stats = mp.cuda.ipc_stats()
        assert stats["lent_blocks"] == 0   # nothing sent from this process yet
        ```
    """
    return _cuda_ipc.stats()
