"""Module-level child targets for the CUDA-sharing tests (spawn imports them by name).

Without a GPU the keep-alive bookkeeping runs on :class:`FakeCuda`, a backend that stands in
for torch's CUDA calls: "device memory" is a fresh CPU storage, IPC handles are bytes naming
the sender's storage, and every call is counted, so tests can see what torch would be asked.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from torch_mp_ext import _C
from torch_mp_ext.cuda import ipc as _cuda_ipc
from torch_mp_ext.cuda.ipc import Shared


class FakeCuda(_cuda_ipc.Backend):
    """The CUDA calls of the keep-alive, faked on CPU storages (see the module docstring)."""

    def __init__(self) -> None:
        self.shared = 0
        self.native_released: list[object] = []
        self.native_collects = 0
        self.opened = 0
        self.events_recorded = 0
        self.events_waited = 0
        self.synchronized = 0

    def share(self, storage: torch.UntypedStorage) -> Shared:
        self.shared += 1
        handle = b"fake:%d:%d" % (os.getpid(), storage.data_ptr())
        return Shared(device=0, handle=handle, nbytes=storage.nbytes(), offset=0,
                      event_handle=b"e" * 64, event_sync=True, native=("native", self.shared))

    def release_native(self, native: object) -> None:
        self.native_released.append(native)

    def collect_native(self) -> None:
        self.native_collects += 1

    def open(self, device: int, handle: bytes, nbytes: int, offset: int) -> torch.UntypedStorage:
        self.opened += 1
        return torch.UntypedStorage(nbytes)

    def record_event(self, device: int) -> tuple[object, bytes, bool]:
        self.events_recorded += 1
        return object(), b"f" * 64, True

    def wait_event(self, device: int, handle: bytes) -> None:
        self.events_waited += 1

    def synchronize(self, device: int) -> None:
        self.synchronized += 1


def install_fake() -> FakeCuda:
    fake = FakeCuda()
    _cuda_ipc.set_backend(fake)
    return fake


# ---- raw counter files -----------------------------------------------------------------


def forward_chain(name, segment_id, tag, first_slot, seconds, q, finish):
    """Keeps `tag` referenced while moving it from slot to slot, as forwarders do: acquire
    a new slot with the tag, then release the old one (Note [Counter snapshots]). Reports
    the number of moves, and releases the last slot once `finish` is set."""
    counters = _C.CounterFile.open(name, segment_id)
    old, moves = first_slot, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = counters.acquire(1, tag)
        if got is None:
            continue
        counters.add(old, -1)
        old, moves = got[0], moves + 1
    q.put(moves)
    finish.wait(60)
    counters.add(old, -1)


# ---- keep-alive through real processes (FakeCuda) --------------------------------------


def receive_and_hold(payload, q, release):
    """Rebuilds a lent storage, reports (pid, holder key, opens), drops it when `release` is
    set, reports (\"released\", stream syncs), and exits."""
    fake = install_fake()
    storage = _cuda_ipc.receive(*payload)
    q.put((os.getpid(), _C.holder_key(), fake.opened))
    release.wait(60)
    del storage
    q.put(("released", fake.synchronized))


def receive_then_exit(payload, q):
    """Rebuilds a lent storage and exits (through os._exit) while still holding it."""
    install_fake()
    storage = _cuda_ipc.receive(*payload)
    q.put(storage.nbytes())


def receive_and_hang(payload, q):
    """Rebuilds a lent storage and waits to be killed."""
    install_fake()
    storage = _cuda_ipc.receive(*payload)  # noqa: F841  (held until SIGKILL)
    q.put(os.getpid())
    while True:
        time.sleep(1)


def receive_twice(first, second, q):
    """Rebuilds two payloads of one block: one storage, the second slot given back."""
    fake = install_fake()
    a = _cuda_ipc.receive(*first)
    b = _cuda_ipc.receive(*second)
    q.put((a._cdata == b._cdata, fake.opened, fake.events_waited, _cuda_ipc.stats()))


def receive_and_forward(payload, out, done):
    """Rebuilds a lent storage, forwards it to the next process, drops it, and exits once
    `done` is set."""
    fake = install_fake()
    storage = _cuda_ipc.receive(*payload)
    out.put(_cuda_ipc.send(storage))
    del storage
    done.wait(60)
    out.put(("forwarder done", fake.events_recorded))


def produce_and_exit(q, exit_wait, stderr_path, nbytes):
    """Lends one storage to the parent, drops its own reference, and exits: the exit waits
    up to `exit_wait` s for the parent to release it, then warns (into `stderr_path`)."""
    sys.stderr = open(stderr_path, "w", buffering=1)  # noqa: SIM115  (kept until exit)
    import torch_mp_ext.cuda

    torch_mp_ext.cuda.set_exit_wait(exit_wait, unreceived=None)
    install_fake()
    storage = torch.UntypedStorage(nbytes)
    q.put(_cuda_ipc.send(storage))
    del storage
    q.put("sent")


def lend_to_nobody_and_exit(q, stderr_path):
    """Lends a block in a message nobody receives, then exits (exit wait 30 s, of which at
    most 0.5 s for unreceived blocks)."""
    sys.stderr = open(stderr_path, "w", buffering=1)  # noqa: SIM115  (kept until exit)
    import torch_mp_ext.cuda

    torch_mp_ext.cuda.set_exit_wait(30, unreceived=0.5)
    install_fake()
    _cuda_ipc.send(torch.UntypedStorage(1000))
    q.put("lent")


def produce_tensor_and_wait(q, done):
    """Pickles a tensor through the CUDA reducer (FakeCuda) for the parent; waits."""
    from torch_mp_ext import reductions

    install_fake()
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    q.put([reductions.reduce_cuda_tensor(x)[1] for x in (t[1:], p, torch.empty(0))])
    done.wait(60)
    _cuda_ipc.collect()
    q.put(_cuda_ipc.stats())


def drop_inherited_and_exit(q, storage_box):
    """A forked child: drops its copy of the parent's received storage and exits."""
    storage_box.clear()
    import gc

    gc.collect()
    q.put("dropped")


# ---- on a GPU (tests/test_cuda.py) -------------------------------------------------------


def cuda_fill(q, done):
    """torch's simple_fill: writes 4 into every received tensor (they share one storage)."""
    import torch_mp_ext  # noqa: F401  (our reducers)

    data = q.get(timeout=60)
    data[0][:] = 4
    torch.cuda.synchronize()  # the parent reads as soon as `done` is set
    done.set()


def cuda_send_twice(q, done):
    import torch_mp_ext  # noqa: F401

    t = torch.ones(5, 5, device="cuda")
    q.put(t)
    q.put(t)
    done.wait(60)


def cuda_send_and_delete(q, done, count):
    """torch's send_and_delete_tensors: the producer drops each tensor right after put()."""
    import torch_mp_ext  # noqa: F401

    for i in range(count):
        t = torch.full([5], i, device="cuda", dtype=torch.int32)
        q.put(t)
        del t
    done.wait(60)


def cuda_multiply_two(q, ready, done):
    """torch's cuda_multiply_two: waits on the sender's event, doubles, records."""
    import torch_mp_ext  # noqa: F401

    ready.set()
    with torch.cuda.stream(torch.cuda.Stream()):
        event, tensor = q.get(timeout=60)
        event.wait()
        tensor.mul_(2)
        event.record()
        done.set()
        del event


def cuda_forward(q_in, q_out, done):
    """Receives a CUDA tensor, sends it on (no clone), drops it, exits when `done` is set."""
    import torch_mp_ext  # noqa: F401

    t = q_in.get(timeout=60)
    q_out.put(t)
    del t
    done.wait(60)


def cuda_read_write_hold(q_in, q_out, release):
    """Receives a CUDA tensor, reports its sum, writes 7 into it, holds it until `release`."""
    import torch_mp_ext  # noqa: F401

    t = q_in.get(timeout=60)
    q_out.put(float(t.sum()))
    t.fill_(7)
    torch.cuda.synchronize()
    q_out.put("written")
    release.wait(60)
    del t
    q_out.put("released")


def cuda_sum_and_drop(q_in, q_out, count):
    """Receives `count` CUDA tensors, sums them, drops each at once; reports the total and
    this process's torch.cuda.memory_allocated() before and after."""
    import torch_mp_ext  # noqa: F401

    torch.cuda.init()
    before = torch.cuda.memory_allocated()
    total = 0.0
    for _ in range(count):
        t = q_in.get(timeout=60)
        total += float(t.sum())
        del t
    q_out.put((total, before, torch.cuda.memory_allocated()))


def cuda_share_torch_format(q, done):
    """Shares a CUDA tensor the way torch's test_rebuild_cuda_tensor does: the keyword spec
    from ``_share_cuda_()`` (torch's counter file, not ours)."""
    t = torch.arange(6, dtype=torch.float32, device="cuda")
    storage = t._typed_storage()
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
     event_sync) = storage._share_cuda_()
    q.put(dict(tensor_cls=type(t), tensor_size=t.size(), tensor_stride=t.stride(),
               tensor_offset=t.storage_offset(), storage_cls=type(storage), dtype=t.dtype,
               storage_device=device, storage_handle=handle, storage_size_bytes=size_bytes,
               storage_offset_bytes=offset_bytes, requires_grad=False,
               ref_counter_handle=ref_handle, ref_counter_offset=ref_offset,
               event_handle=event_handle, event_sync_required=event_sync))
    done.wait(60)
