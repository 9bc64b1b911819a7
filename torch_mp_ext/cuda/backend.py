"""The CUDA calls the keep-alive makes, all through torch's Python API.

torch_mp_ext builds without CUDA or torch headers, so every CUDA handle comes from torch:
``UntypedStorage._share_cuda_()`` (the IPC handle of the whole allocation, the storage's offset
in it, an interprocess event recorded on the current stream, and torch's own keep-alive
wrapper), ``UntypedStorage._new_shared_cuda(...)`` (opening a handle through the caching
allocator's per-process cache of opened handles), ``_release_ipc_counter_cuda`` and
``torch.cuda.ipc_collect()`` (torch's keep-alive), and ``torch.cuda.Event`` (interprocess
events). The bookkeeping in ``_cuda_ipc`` talks to a :class:`Backend`; tests without a GPU
substitute one that fakes these calls (``tests/_cuda_workers.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import torch_internals as _ti

__all__ = ["NO_TORCH_COUNTER", "Backend", "Shared", "TorchCuda"]

#: What receivers pass to ``_new_shared_cuda`` as torch's ref-counter name: none. The
#: storage's deleter still syncs the stream, then fails to open this name and (by design,
#: "best effort") ignores it; our own slot is released by our finalizer instead
#: (Note [CUDA lifetimes] in ``_cuda_ipc``).
NO_TORCH_COUNTER = b""


@dataclasses.dataclass(frozen=True)
class Shared:
    """What sharing one CUDA storage gave: torch's IPC handle, and torch's keep-alive.

    Attributes:
        device: the CUDA device index.
        handle: IPC handle of the whole allocation holding the storage (bytes).
        nbytes: the storage's size in bytes.
        offset: the storage's byte offset in that allocation.
        event_handle: an interprocess event recorded on the sender's current stream.
        event_sync: False if no event was recorded (the stream was synchronised instead).
        native: torch's keep-alive for this send (its counter file name and slot), released
            through :meth:`Backend.release_native` once nothing needs the block any more.
    """

    device: int
    handle: bytes
    nbytes: int
    offset: int
    event_handle: bytes
    event_sync: bool
    native: Any


class Backend:
    """The CUDA operations of Note [CUDA lifetimes]; :class:`TorchCuda` does them for real."""

    def share(self, storage: torch.UntypedStorage) -> Shared:
        """Producer: the IPC handle of ``storage`` and a new keep-alive of torch's for it."""
        raise NotImplementedError

    def release_native(self, native: Any) -> None:
        """Producer: drops a keep-alive :meth:`share` returned."""
        raise NotImplementedError

    def collect_native(self) -> None:
        """Producer: lets torch free the blocks whose keep-alives were dropped."""
        raise NotImplementedError

    def open(self, device: int, handle: bytes, nbytes: int, offset: int) -> torch.UntypedStorage:
        """Receiver: a storage on ``nbytes`` at ``offset`` of the allocation ``handle`` names."""
        raise NotImplementedError

    def record_event(self, device: int) -> tuple[Any, bytes, bool]:
        """Forwarder: (event to keep alive, its IPC handle, True) recorded on the current
        stream of ``device``."""
        raise NotImplementedError

    def wait_event(self, device: int, handle: bytes) -> None:
        """Receiver: makes the current stream of ``device`` wait for the sender's event."""
        raise NotImplementedError

    def synchronize(self, device: int) -> None:
        """Receiver: waits for the current stream of ``device`` (before releasing a slot)."""
        raise NotImplementedError


class TorchCuda(Backend):
    """:class:`Backend` over torch's CUDA IPC calls (see the module docstring)."""

    def share(self, storage: torch.UntypedStorage) -> Shared:
        # Raises torch's "Attempted to send CUDA tensor received from another process ...
        # Consider cloning before sending." for storages torch itself received.
        (device, handle, nbytes, offset, counter, counter_offset, event_handle,
         event_sync) = storage._share_cuda_()
        return Shared(device, handle, nbytes, offset, event_handle, bool(event_sync),
                      (counter, counter_offset))

    def release_native(self, native: Any) -> None:
        _ti.release_ipc_counter_cuda(*native)

    def collect_native(self) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()

    def open(self, device: int, handle: bytes, nbytes: int, offset: int) -> torch.UntypedStorage:
        _ti.cuda_lazy_init()
        # Event handling is ours (wait_event), so no event here; torch's counter: none.
        return _ti.new_shared_cuda(
            device, handle, nbytes, offset, NO_TORCH_COUNTER, 0, bytes(64), False
        )

    def record_event(self, device: int) -> tuple[Any, bytes, bool]:
        if torch.version.hip:  # HIP has no IPC events: synchronise instead, as torch does
            self.synchronize(device)
            return None, bytes(64), False
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(device))
        return event, event.ipc_handle(), True

    def wait_event(self, device: int, handle: bytes) -> None:
        event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", device), handle)
        torch.cuda.current_stream(device).wait_event(event)

    def synchronize(self, device: int) -> None:
        if torch.cuda.is_initialized():  # else no stream of this process has work on it
            torch.cuda.current_stream(device).synchronize()
