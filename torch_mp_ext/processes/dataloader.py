"""DataLoader workers started by torch_mp_ext's contexts build their batches in arena blocks.

Note [Batches born in the arena]
``DataLoader(num_workers>0, multiprocessing_context=torch_mp_ext.get_context(m))`` starts each
worker as one of our Process classes with ``target=torch.utils.data._utils.worker._worker_loop``.
Such a process (and only such a process: :func:`is_worker_loop` compares the target by module
and name before ``run()``) replaces ``torch.UntypedStorage._new_shared`` for CPU storages with
one that returns a storage over a recycled arena block (:func:`arena_new_shared`). torch's
``default_collate`` calls exactly that in a worker (``elem._typed_storage()._new_shared(numel)``,
then ``torch.stack(batch, out=...)``), so a batch is stacked straight into a block that is
already mapped and faulted in, instead of a fresh torch segment (create, fault in every page,
pass an fd, map, unmap). The batch then crosses the result queue as a block handle; the main
process maps the block's segment once and keeps the mapping, and when it drops the batch the
block's refcount reaches zero and the block goes back to the worker's pool (Note [Block
lifetime] in ``csrc/shm/layout.h``). Steady-state memory is thus bounded by the batches alive
at once: ``num_workers x prefetch_factor`` in flight plus those the user holds.

Tensors a custom ``collate_fn`` builds in private memory are moved into a block when the
result queue pickles them (one copy, into a recycled block, ``reductions.reduce_tensor``);
numpy arrays of 64 KiB or more are copied into a block likewise (``reductions.reduce_array``).

What this relies on in torch, each checked by ``tests/test_dataloader_arena.py`` so that a
torch that changes it fails there loudly: the worker target's module and name, the classmethod
``torch.UntypedStorage._new_shared(size, *, device)``, and ``default_collate`` reaching it in a
worker. Both names are looked up when torch_mp_ext is imported (Note [Torch internals] in
``torch_internals.py``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import torch_internals as _ti
from ..sharing import memory

__all__ = ["WORKER_LOOP", "is_worker_loop", "install", "installed", "arena_new_shared"]

#: (module, name) of the function DataLoader runs in each worker process.
WORKER_LOOP = _ti.WORKER_LOOP

_torch_new_shared: Callable[..., Any] | None = None


def is_worker_loop(target: Any) -> bool:
    """True if ``target`` is torch's DataLoader worker loop."""
    return (getattr(target, "__module__", None), getattr(target, "__qualname__", None)) == (
        WORKER_LOOP
    )


def arena_new_shared(cls: Any, size: int, *, device: Any = "cpu") -> Any:
    """``UntypedStorage._new_shared`` of a worker: a CPU storage of ``size`` bytes over an
    arena block (Note [Batches born in the arena]); other devices and empty storages go to
    torch's implementation."""
    if size <= 0 or cls is not torch.UntypedStorage or torch.device(device).type != "cpu":
        original = _torch_new_shared or _ti.new_shared
        return original(size, device=device)
    return memory.storage_from_block(memory.allocate(size), 0, size)


def installed() -> bool:
    """True once :func:`install` has replaced ``_new_shared`` in this process."""
    return _torch_new_shared is not None


def install() -> bool:
    """Makes this process's ``UntypedStorage._new_shared`` allocate CPU storages in arena
    blocks. Called in a DataLoader worker process before torch's loop starts; idempotent.
    Returns True (the name is checked at import: Note [Torch internals])."""
    global _torch_new_shared
    if _torch_new_shared is None:
        _torch_new_shared = _ti.replace_new_shared(arena_new_shared)
    return True
