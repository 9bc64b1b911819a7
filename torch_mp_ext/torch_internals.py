"""Every private part of torch that torch_mp_ext relies on, in one module, checked at import.

Note [Torch internals]
torch_mp_ext extends torch's own sharing machinery, so it needs some of torch's private names:
the tensor rebuild function its pickles call, the storage weak references of torch's sharing
cache, the CUDA IPC storage calls, and the DataLoader's worker loop, iterator and signal
handling. They change between torch releases without notice. So they are looked up here and
only here (``tests/test_torch_internals.py`` checks that no other module names one), when
torch_mp_ext is imported:
  - a name that is missing raises :class:`~torch_mp_ext.errors.TorchVersionError` (an
    ``ImportError``) naming it, the torch version and the versions torch_mp_ext was tested
    with: a loud failure at import, never a wrong result at the first tensor sent;
  - a torch outside :data:`TESTED_TORCH` with every name present warns once
    (:class:`~torch_mp_ext.errors.UntestedTorchWarning`): probably fine, never run here.
Attributes of storage objects (``_untyped_storage``, ``_cdata``) are checked on a one-element
tensor. Names needed only on a GPU (``CUDA_NAMES``) are checked when present in the build,
as the CPU wheel has them too.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch

from .errors import TorchVersionError, UntestedTorchWarning

__all__ = [
    "TESTED_TORCH", "check", "rebuild_tensor", "tensor_classes", "storage_classes",
    "get_thread_name", "set_thread_name", "prctl_pr_set_pdeathsig", "free_weak_ref",
    "new_with_weak_ptr", "new_shared", "new_shared_cuda", "release_ipc_counter_cuda",
    "cuda_lazy_init", "replace_new_shared", "worker_loop", "WORKER_LOOP", "DatasetKind",
    "MultiProcessingDataLoaderIter", "remove_worker_pids", "set_worker_signal_handlers",
    "ResumeIteration", "MP_STATUS_CHECK_INTERVAL", "module_structure",
]

#: torch releases (major.minor) the test suite ran on (docs/platforms.md).
TESTED_TORCH = ("2.13", "2.14")


def _lookup(path: str) -> Any:
    """The object at dotted ``path`` (a module, then attributes), or TorchVersionError."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            if not hasattr(obj, name):
                break
            obj = getattr(obj, name)
        else:
            return obj
        break
    raise TorchVersionError(
        f"torch {torch.__version__} has no {path}, which torch_mp_ext needs (Note [Torch "
        f"internals]). torch_mp_ext was tested with torch {', '.join(TESTED_TORCH)}: install "
        f"one of those (pip install 'torch=={TESTED_TORCH[0]}.*'), or a torch_mp_ext release "
        f"made for this torch")


# ---- tensors and storages ----------------------------------------------------------------
rebuild_tensor = _lookup("torch._utils._rebuild_tensor")
tensor_classes = _lookup("torch._tensor_classes")
storage_classes = _lookup("torch._storage_classes")
free_weak_ref = _lookup("torch.UntypedStorage._free_weak_ref")
new_with_weak_ptr = _lookup("torch.UntypedStorage._new_with_weak_ptr")
new_shared = _lookup("torch.UntypedStorage._new_shared")
_lookup("torch.UntypedStorage._weak_ref")

# ---- private names torch.multiprocessing exports (re-exported by ours: a drop-in) ----------
get_thread_name = _lookup("torch.multiprocessing._get_thread_name")
set_thread_name = _lookup("torch.multiprocessing._set_thread_name")
prctl_pr_set_pdeathsig = _lookup("torch.multiprocessing._prctl_pr_set_pdeathsig")

# ---- CUDA IPC (present in CPU builds too; used only with a GPU) --------------------------
CUDA_NAMES = ("torch.UntypedStorage._share_cuda_", "torch.UntypedStorage._new_shared_cuda",
              "torch.UntypedStorage._release_ipc_counter_cuda", "torch.cuda._lazy_init")
new_shared_cuda = _lookup("torch.UntypedStorage._new_shared_cuda")
release_ipc_counter_cuda = _lookup("torch.UntypedStorage._release_ipc_counter_cuda")
cuda_lazy_init = _lookup("torch.cuda._lazy_init")
_lookup("torch.UntypedStorage._share_cuda_")

# ---- DataLoader ------------------------------------------------------------------------
#: (module, name) of the function DataLoader runs in each worker process.
WORKER_LOOP = ("torch.utils.data._utils.worker", "_worker_loop")
worker_loop = _lookup(".".join(WORKER_LOOP))
DatasetKind = _lookup("torch.utils.data.dataloader._DatasetKind")
MultiProcessingDataLoaderIter = _lookup(
    "torch.utils.data.dataloader._MultiProcessingDataLoaderIter")
remove_worker_pids = _lookup("torch.utils.data._utils.signal_handling._remove_worker_pids")
set_worker_signal_handlers = _lookup(
    "torch.utils.data._utils.signal_handling._set_worker_signal_handlers")
ResumeIteration = _lookup("torch.utils.data._utils.worker._ResumeIteration")
MP_STATUS_CHECK_INTERVAL: float = _lookup("torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL")


def replace_new_shared(fn: Any) -> Any:
    """Makes ``fn(cls, size, *, device)`` the classmethod ``torch.UntypedStorage._new_shared``
    in this process (Note [Batches born in the arena] in ``processes/dataloader.py``);
    returns the original."""
    original = torch.UntypedStorage._new_shared
    torch.UntypedStorage._new_shared = classmethod(fn)  # type: ignore[method-assign,assignment]
    return original


def module_structure(module: torch.nn.Module) -> tuple[list[Any], list[tuple[Any, str, Any]]]:
    """Where ``module``'s tensors live, as ``(containers, entries)``: every submodule's
    child, parameter and buffer containers, and every ``(container, name, object)`` entry
    of them. While the containers keep their lengths and entries, the module computes with
    the same tensors (Note [Borrow plans] in ``exchange/borrow.py``)."""
    containers: list[Any] = []
    entries: list[tuple[Any, str, Any]] = []
    for m in module.modules():
        for d in (m._modules, m._parameters, m._buffers):
            containers.append(d)
            entries += [(d, name, obj) for name, obj in d.items()]
    return containers, entries


def check() -> None:
    """Checks what cannot be looked up by name (attributes of live objects) and the version;
    raises TorchVersionError or warns UntestedTorchWarning (Note [Torch internals])."""
    try:
        module_structure(torch.nn.Linear(1, 1))
    except AttributeError as e:
        _lookup(f"torch.nn.Module.{e.name}")  # raises, naming it
    typed = torch.zeros(1)._typed_storage()
    for obj, attr in ((typed, "_untyped_storage"), (typed._untyped_storage, "_cdata")):
        if not hasattr(obj, attr):
            _lookup(f"torch.{type(obj).__name__}.{attr}")  # raises, naming it
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if release not in TESTED_TORCH:
        warnings.warn(
            f"torch_mp_ext was tested with torch {', '.join(TESTED_TORCH)}, not {release} "
            f"(torch {torch.__version__}): every private name it needs is present, so it "
            f"probably works; run its test suite to be sure (Note [Torch internals])",
            UntestedTorchWarning, stacklevel=3)


check()
