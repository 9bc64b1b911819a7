"""The child process of tests/test_fuzz.py: applies hostile bytes, calls the public API.

It reads cases (pickled dicts, length-prefixed) on stdin and answers each on stdout with
``(outcome, exception type name, message)``. A case never kills it unless torch_mp_ext has a
bug: every hostile input must come back as a Python exception. The parent notices a death by
signal (the bug this suite exists to find) or a hang, and reports the case.

Case kinds (see test_fuzz.py for how they are generated):

- ``segment``: a copy of a real named segment, with ``writes`` applied to its header, slot
  table and holder tables, optionally truncated or grown, is attached through a (possibly
  forged) handle by the reductions a receiver runs, then used and released.
- ``owned``: garbage written into the header of a segment this process owns (its free stack,
  counts, holder table), then allocations and frees.
- ``handle``: a forged handle tuple with no segment behind it, rebuilt as a tensor or array.
- ``ring``: garbage written into a live queue's ring, its robust mutex, conditions, doorbell
  word and holder table included (Note [What the fuzzer leaves alone] in test_fuzz.py), then
  the queue is reopened from a pickle and used; ``self_owner`` makes the mutex's owner this
  very thread or a live process that does not hold the queue.
"""

from __future__ import annotations

import ctypes
import gc
import os
import pickle
import queue
import random
import signal
import struct
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import torch

import torch_mp_ext
from torch_mp_ext import _C, reductions
from torch_mp_ext.queues import ring_queue

SEG_FIELDS = {name: (offset, size) for name, offset, size in _C.segment_layout()}
RING_FIELDS = {name: (offset, size) for name, offset, size in _C.Ring.layout()}
FUZZ_PREFIX = f"/torch_fz{os.getpid()}_"


def pack(value: int, size: int) -> bytes:
    return (value % (1 << (8 * size))).to_bytes(size, "little")


def apply_writes(buf: Any, writes: list, limit: int) -> None:
    """``writes``: (offset, raw bytes) pairs; offsets wrap into [0, limit)."""
    for offset, data in writes:
        offset %= max(limit, 1)
        data = data[: limit - offset]
        buf[offset:offset + len(data)] = data


# ---- segments received from a hostile peer -----------------------------------------------


class Template:
    """Bytes of a real named segment holding one block with one handle in flight."""

    def __init__(self) -> None:
        block = _C.allocate(4096, True)
        self.handle = block.share()
        path = "/dev/shm" + block.name
        with open(path, "rb") as f:
            self.data = f.read()
        _C.release_handle(self.handle)
        del block
        gc.collect()
        self.counter = 0


def use_block(obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.numel():
            obj.view(-1)[-1] = 1
            float(obj.float().sum())
    elif isinstance(obj, torch.TypedStorage):
        if obj.size():
            obj.fill_(1)  # what died of SIGSEGV on a misaligned complex128 storage
    elif isinstance(obj, np.ndarray):
        if obj.size:
            obj.reshape(-1)[-1] = 1
            float(obj.astype(np.float64).sum())


def rebuild(api: str, handle: tuple, args: dict) -> Any:
    nbytes = args.get("nbytes", 4096)
    if api == "tensor":
        return reductions.rebuild_cpu_tensor(
            handle, args.get("offset", 0), nbytes, args.get("dtype", torch.uint8),
            args.get("size", (nbytes,)), args.get("stride", (1,)),
            args.get("storage_offset", 0), False, None)
    if api == "storage":
        return reductions.rebuild_storage(torch.UntypedStorage, handle, args.get("offset", 0),
                                          nbytes)
    if api == "typed_storage":  # a TypedStorage pickle: its untyped storage, then the dtype
        storage = reductions.rebuild_storage(torch.UntypedStorage, handle,
                                             args.get("offset", 0), nbytes)
        return reductions.rebuild_typed_storage(storage, args.get("dtype", torch.uint8))
    if api == "array":
        return reductions.rebuild_array(handle, args.get("offset", 0),
                                        args.get("size", (nbytes,)),
                                        np.dtype(args.get("np_dtype", "uint8")),
                                        args.get("strides"), True)
    if api == "pickle":  # the whole unpickling path, as a receiving process runs it
        payload = pickle.dumps((reductions.rebuild_cpu_tensor,
                                (handle, 0, nbytes, torch.uint8, (nbytes,), (1,), 0, False,
                                 None)))
        func, fargs = pickle.loads(payload)
        return func(*fargs)
    _C.release_handle(handle)
    return None


def run_segment(t: Template, case: dict) -> None:
    data = bytearray(t.data)
    new_id = random.getrandbits(64) or 1
    off, size = SEG_FIELDS["segment_id"]
    data[off:off + size] = pack(new_id, size)
    t.counter += 1
    name = f"{FUZZ_PREFIX}{t.counter}"
    off, size = SEG_FIELDS["name"]
    data[off:off + size] = name.encode().ljust(size, b"\0")
    apply_writes(data, case["writes"], len(data))
    path = "/dev/shm" + name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, bytes(data))
        if case.get("truncate") is not None:
            os.ftruncate(fd, case["truncate"] % (2 * len(data)))
    finally:
        os.close(fd)
    handle = [True, new_id, 0, len(data), 0, t.handle[5], os.getpid(), name]
    for index, value in case.get("handle", {}).items():
        handle[index] = value
    obj = None
    try:
        obj = rebuild(case["api"], tuple(handle), case.get("args", {}))
        use_block(obj)
        if case.get("reclaim"):
            _C.reclaim_dead_holders()
            torch_mp_ext.empty_cache()
    finally:
        del obj
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# ---- a segment this process owns, scribbled on by a peer ------------------------------------


def run_owned(case: dict) -> None:
    nbytes = case["nbytes"]
    keep = [torch_mp_ext.empty(nbytes, dtype=torch.uint8) for _ in range(2)]
    block = _C.attach(reductions._share(keep[0].untyped_storage())[0])
    base = block.segment_address
    del block
    for offset, raw in case["writes"]:
        offset %= SEG_FIELDS["slots"][0] + 4 * SEG_FIELDS["slots"][1]  # header and 4 slots
        ctypes.memmove(base + offset, raw, len(raw))
    try:
        more = [torch_mp_ext.empty(nbytes, dtype=torch.uint8) for _ in range(3)]
        for tensor in more:
            tensor.fill_(1)
        del more
        if case.get("reclaim"):
            _C.reclaim_dead_holders()
            torch_mp_ext.empty_cache()
    finally:
        del keep


# ---- queues ---------------------------------------------------------------------------------


BYSTANDER: list = []  # a live process that holds no queue: an owner that is not a holder


def owner_tid(kind: str) -> int:
    if kind == "thread":
        return threading.get_native_id()
    if not BYSTANDER:
        script = ("import os, time\nparent = os.getppid()\n"  # ends with this worker
                  "while os.getppid() == parent:\n    time.sleep(0.2)\n")
        BYSTANDER.append(subprocess.Popen([sys.executable, "-c", script],
                                          stdin=subprocess.DEVNULL))
    return BYSTANDER[0].pid


def run_ring(case: dict) -> None:
    cls = getattr(torch_mp_ext, case["cls"])
    simple = case["cls"] == "SimpleQueue"
    q = cls(max_bytes=case["max_bytes"]) if simple else cls(maxsize=case["maxsize"],
                                                            max_bytes=case["max_bytes"])
    others: list = []
    try:
        for item in case["items"]:
            try:
                ring_queue._RingQueue.put(q, item, timeout=0.01)
            except queue.Full:
                break
        buf = memoryview(q._ring.block).cast("B")
        for offset, raw in case["writes"]:
            offset %= len(buf)
            raw = raw[: len(buf) - offset]
            buf[offset:offset + len(raw)] = raw
        if case.get("self_owner"):
            at = RING_FIELDS["mutex"][0]
            buf[at:at + 4] = struct.pack("<I", owner_tid(case["self_owner"]))
        del buf
        targets = [q]
        if case["reopen"]:
            others.append(pickle.loads(pickle.dumps(q)))
            targets = others + [q]
        for target in targets:
            for op in case["ops"]:
                call_queue(target, op, simple)
    finally:
        for target in others + [q]:
            try:
                target.close()
            except (ValueError, RuntimeError, OSError):
                pass
        del others, q


def call_queue(q: Any, op: str, simple: bool) -> None:
    try:
        if op == "get":
            if simple:  # SimpleQueue.get() waits for ever: only when an item is there
                if q._ring.qsize() > 0:
                    q.get()
            else:
                q.get(timeout=0.005)
        elif op == "get_nowait":
            if simple:
                q._reader.poll(0)
            else:
                q.get_nowait()
        elif op == "put":
            ring_queue._RingQueue.put(q, b"x" * 8, timeout=0.005)
            if simple:
                q._after_put()
        elif op == "put_many":
            q.put_many([1, 2, 3], timeout=0.005)
        elif op == "get_many":
            q.get_many(4, timeout=0.005)
        elif op == "qsize":
            q.qsize()
        elif op == "empty":
            q.empty()
        elif op == "task_done" and hasattr(q, "task_done"):
            q.task_done()
        elif op == "join" and hasattr(q, "task_done"):
            q.join(timeout=0.005)
        elif op == "doorbell" and simple:
            q._reader.fileno()
            q._after_get()
        elif op == "close":
            q.close()
    except (queue.Empty, queue.Full):
        pass


# ---- public functions called with hostile arguments ------------------------------------------


def _values() -> dict:
    """The hostile values a ``call`` case picks from, by name (cases are pickled: names)."""
    return {
        "none": None, "true": True, "zero": 0, "one": 1, "neg": -1, "big": 2**63,
        "huge": 2**70, "nan": float("nan"), "inf": float("inf"), "float": 1.5, "str": "3",
        "bytes": b"\0" * 3, "list": [2, 3], "neg_list": [2, -3], "huge_list": [2**40, 2**40],
        "wrap_list": [3, 6148914691236517206], "tuple": (4,), "empty_tuple": (),
        "object": object(), "dtype_obj": object, "np_obj": np.dtype("O"), "np_f4": np.float32,
        "torch_f4": torch.float32, "torch_c": torch.complex64, "tensor": torch.zeros(3),
        "meta": torch.empty(3, device="meta"), "noncontig": torch.zeros(4, 4).t(),
        "array": np.zeros(3), "obj_array": np.array([None, 1], dtype=object),
        "struct": np.zeros(2, dtype=[("a", "i4"), ("b", "O")]), "dict": {"w": torch.zeros(2)},
        "bad_dict": {"w": 3}, "module": torch.nn.Linear(2, 2), "zero_d": torch.tensor(1.0),
    }


VALUES = _values()

CALLS = {
    "empty": torch_mp_ext.empty, "zeros": torch_mp_ext.zeros,
    "empty_like": torch_mp_ext.empty_like, "empty_array": torch_mp_ext.empty_array,
    "zeros_array": torch_mp_ext.zeros_array, "share_": torch_mp_ext.share_,
    "is_shared": torch_mp_ext.is_shared, "Queue": torch_mp_ext.Queue,
    "JoinableQueue": torch_mp_ext.JoinableQueue, "ArrayQueue": torch_mp_ext.ArrayQueue,
    "StateDictChannel": torch_mp_ext.StateDictChannel,
}


def run_call(case: dict) -> None:
    func = CALLS[case["func"]]
    args = [VALUES[name] for name in case["args"]]
    kwargs = {key: VALUES[name] for key, name in case["kwargs"].items()}
    result = func(*args, **kwargs)
    close = getattr(result, "close", None)
    if callable(close):
        close()


# ---- the loop -------------------------------------------------------------------------------

HANDLED = (ValueError, TypeError, RuntimeError, OSError, OverflowError, EOFError,
           pickle.UnpicklingError, IndexError, KeyError, AttributeError)


def main() -> None:
    template = Template()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(b"R")
    stdout.flush()
    runners = {"segment": lambda c: run_segment(template, c), "owned": run_owned,
               "handle": lambda c: run_segment(template, c), "ring": run_ring,
               "call": run_call,
               "crash": lambda c: os.kill(os.getpid(), c["signal"]),  # the harness's own test
               "hang": lambda c: signal.pause()}
    cases = 0
    while True:
        head = stdin.read(4)
        if len(head) < 4:
            for proc in BYSTANDER:
                proc.kill()
                proc.wait()
            return
        case = pickle.loads(stdin.read(struct.unpack("<I", head)[0]))
        try:
            runners[case["kind"]](case)
            answer = ("ok", "", "")
        except HANDLED as exc:
            answer = ("raised", type(exc).__name__, str(exc)[:300])
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails
            answer = ("unexpected", type(exc).__name__, str(exc)[:300])
        cases += 1
        if cases % 500 == 0:
            gc.collect()  # ~0.2 s with torch loaded: not per case
        reply = pickle.dumps(answer)
        stdout.write(struct.pack("<I", len(reply)) + reply)
        stdout.flush()


if __name__ == "__main__":
    main()
