"""Lean tensor records (Note [Lean tensor records]): which tensors take them, what arrives,
what a dropped or malformed record does, and that the reference each carries is kept."""

from __future__ import annotations

import os
import pickle
import queue

import pytest
import torch

import torch_mp_ext as mp
from torch_mp_ext import _C
from torch_mp_ext.errors import CorruptSegmentError
from torch_mp_ext.sharing import records
from torch_mp_ext.sharing.pickling import TAG_RECORD

T = 30.0


def _frame_tag(q, obj):
    """The tag of the frame `obj` becomes, read back raw (then rebuilt, so nothing leaks)."""
    q.put(obj)
    got = q._ring.get(T)
    if type(got) is bytes:
        return 0, pickle.loads(got)
    tag, data = got
    return tag, (records.rebuild(data) if tag == TAG_RECORD else None)


def _refcount(t):
    block = _C.attach(_C.share_address(t.untyped_storage().data_ptr(),
                                       t.untyped_storage().nbytes())[0])
    return block.refcount  # counted per process (and per message in flight), not per object


@pytest.mark.parametrize("make", [
    lambda: mp.empty(3, 4).fill_(2),
    lambda: mp.empty(5, 6)[1:, ::2].fill_(3),                 # a strided view
    lambda: mp.empty(()).fill_(7),                            # zero-dim
    lambda: mp.zeros(8, dtype=torch.bool),
    lambda: mp.empty(8, dtype=torch.bfloat16).fill_(1.5),
    lambda: mp.empty(8, dtype=torch.uint16).fill_(9),
    lambda: torch.arange(10.0),                               # fresh: moved in place first
    lambda: mp.zeros(4).requires_grad_(),                     # a leaf that requires grad
], ids=["dense", "view", "zero-dim", "bool", "bfloat16", "uint16", "fresh", "requires-grad"])
def test_plain_cpu_tensors_cross_as_records_and_arrive_equal(make):
    q = mp.SimpleQueue()
    t = make()
    tag, got = _frame_tag(q, t)
    assert tag == TAG_RECORD
    assert torch.equal(got.detach(), t.detach()) and got.dtype == t.dtype
    assert (got.shape, got.stride(), got.storage_offset()) == (t.shape, t.stride(),
                                                               t.storage_offset())
    assert got.requires_grad == t.requires_grad and got.is_leaf
    assert got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # zero-copy
    q.close()


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("make", [
    lambda: torch.nn.Parameter(mp.zeros(3)),                  # a subclass: pickled
    lambda: mp.zeros(3, dtype=torch.complex64),               # conj/neg bits: pickled
    lambda: mp.zeros(3).requires_grad_() * 2,                 # a non-leaf: torch's error
    lambda: torch.zeros(0),                                   # nothing to share
    lambda: torch.zeros(4, 4).to_sparse(),
], ids=["parameter", "complex", "non-leaf", "empty", "sparse"])
def test_everything_else_is_pickled_as_before(make):
    q = mp.SimpleQueue()
    t = make()
    if t.requires_grad and not t.is_leaf:
        with pytest.raises(RuntimeError, match="non-leaf"):
            q.put(t)
        q.close()
        return
    tag, got = _frame_tag(q, t)
    assert tag == 0
    assert type(got) is type(t) and torch.equal(got.to_dense(), t.to_dense())
    q.close()


def test_the_same_storage_rebuilds_as_the_same_storage():
    """Note [Identity of rebuilt storages]: a round trip in one process, and two views of
    one storage, give back the sender's storage object."""
    q = mp.SimpleQueue()
    t = mp.empty(16).fill_(1)
    q.put(t)
    q.put(t[4:8])
    a, b = q.get(), q.get()
    assert a.untyped_storage()._cdata == t.untyped_storage()._cdata
    assert b.untyped_storage()._cdata == t.untyped_storage()._cdata
    b.fill_(5)
    assert t[4:8].eq(5).all() and a[4:8].eq(5).all()
    q.close()


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_records_cross_processes_and_the_receiver_writes_through(strategy):
    prev = mp.get_sharing_strategy()
    mp.set_sharing_strategy(strategy)
    try:
        ctx = mp.get_context("fork")
        q, back = ctx.Queue(), ctx.Queue()
        t = mp.zeros(1000)
        p = ctx.Process(target=_add_one_and_echo, args=(q, back))
        p.start()
        q.put(t)
        q.put_many([t[:10], t[10:20]])
        assert back.get(timeout=T) == "done"
        p.join(T)
        assert p.exitcode == 0
        assert t[:20].eq(3).all() and t[20:].eq(1).all()
        assert _refcount(t) == 1  # the child's references are all gone
    finally:
        mp.set_sharing_strategy(prev)


def _add_one_and_echo(q, back):
    t = q.get(timeout=T)
    t.add_(1)
    for view in q.get_many(2, timeout=T):
        view.add_(1)
    t[:20].add_(1)
    del t, view
    back.put("done")


def test_a_record_nobody_takes_gives_its_reference_back():
    t = mp.zeros(100)
    assert _refcount(t) == 1
    q = mp.Queue(maxsize=1)
    q.put(t)
    assert _refcount(t) == 2  # the one in flight
    with pytest.raises(queue.Full):
        q.put(t, timeout=0.01)  # Note [Failed puts]: released
    assert _refcount(t) == 2
    q.close()
    q.join_thread()
    del q  # the last holder drains the ring: the frame's reference goes
    assert _refcount(t) == 1


@pytest.mark.parametrize("damage", [
    lambda d: d[:40],                                  # truncated head
    lambda d: b"XXXX" + d[4:],                         # wrong magic
    lambda d: d[:4] + b"\x09" + d[5:],                 # unknown version
    lambda d: d[:7] + b"\xff" + d[8:],                 # ndim 255
    lambda d: d + b"\0" * 8,                           # wrong length
], ids=["truncated", "magic", "version", "ndim", "length"])
def test_a_malformed_record_is_an_error_never_a_crash(damage):
    t = mp.zeros(10)
    data = records.share_tensor(t)
    with pytest.raises(CorruptSegmentError, match="malformed"):
        records.rebuild(damage(data))
    records.release(data)
    assert _refcount(t) == 1


def test_forged_dtype_and_extent_raise_and_release_the_reference():
    t = mp.zeros(10)
    data = bytearray(records.share_tensor(t))
    data[8] = 200  # dtype code (RecordHead.dtype, little-endian)
    with pytest.raises(CorruptSegmentError, match="dtype code 200"):
        records.rebuild(bytes(data))
    assert _refcount(t) == 1
    data = bytearray(records.share_tensor(t))
    data[64:72] = (1 << 40).to_bytes(8, "little")  # nbytes far past the block
    with pytest.raises((ValueError, RuntimeError)):
        records.rebuild(bytes(data))
    assert _refcount(t) == 1


def test_a_child_forked_later_sees_the_same_tensors():
    """Records keep working across fork: the cache and the pid are the child's own."""
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()
    t = mp.empty(4).fill_(4)
    q.put(t)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        got = q.get()
        os.write(w, b"ok" if torch.equal(got, t) else b"no")
        os._exit(0)
    os.close(w)
    assert os.read(r, 2) == b"ok"
    os.close(r)
    assert os.waitpid(pid, 0)[1] == 0
    q.close()


@pytest.mark.parametrize("view", [lambda a: a, lambda a: a[::-1, 1::2], lambda a: a.T],
                         ids=["whole", "reversed-strided", "transposed"])
def test_arrays_in_blocks_cross_as_records_and_view_the_same_memory(view):
    import numpy as np

    q = mp.SimpleQueue()
    a = mp.empty_array((4, 6), "int32")
    a[:] = np.arange(24).reshape(4, 6)
    x = view(a)
    tag, got = _frame_tag(q, x)
    assert tag == TAG_RECORD
    assert np.array_equal(got, x) and got.strides == x.strides and got.dtype == x.dtype
    assert got.__array_interface__["data"][0] == x.__array_interface__["data"][0]
    got[...] = -1
    assert (x == -1).all()
    a.flags.writeable = False
    _, ro = _frame_tag(q, a)
    assert not ro.flags.writeable
    q.close()


def test_arrays_outside_blocks_or_of_odd_dtypes_are_pickled():
    import numpy as np

    q = mp.SimpleQueue()
    for arr in (np.arange(10.0), mp.empty_array(3, ">f4"), np.array([object()])):
        tag, got = _frame_tag(q, arr)
        assert tag == 0 and got.dtype == arr.dtype and got.shape == arr.shape
    q.close()


@pytest.mark.parametrize("make", [
    lambda: mp.empty(3, 4),                    # dense
    lambda: mp.empty(1, 5, 1),                 # size-1 dims: their strides do not matter
    lambda: mp.empty(1, 5).as_strided((1, 5), (99, 1)),
    lambda: mp.empty(4, 6).t(),                # transposed: not contiguous
    lambda: mp.empty(10)[2:],                  # a storage offset
    lambda: mp.empty(10)[:5],                  # part of the storage
    lambda: mp.empty(6)[::2],                  # strided
    lambda: mp.empty(()),                      # zero-dim
], ids=["dense", "size-1", "size-1-odd-stride", "transposed", "offset", "prefix", "strided",
        "zero-dim"])
def test_the_dense_flag_is_torchs_contiguity_over_the_whole_storage(make):
    """The C++ side sets DENSE (frombuffer on arrival) exactly when the view starts at the
    storage's first byte, is contiguous by torch's rule and ends at its last byte."""
    t = make()
    data = records.share_tensor(t)
    flags = _C.read_record(data)[3]
    records.release(data)
    expected = (t.storage_offset() == 0 and t.is_contiguous()
                and t.numel() * t.element_size() == t.untyped_storage().nbytes())
    assert bool(flags & records.DENSE) == expected


def test_an_item_too_large_for_a_tiny_queue_gives_its_reference_back():
    t = mp.zeros(2, 3, 4, 5, 6, 7)  # a six-dimensional record: about 200 bytes
    q = mp.Queue(max_bytes=64)
    with pytest.raises(ValueError, match="can ever hold"):
        q.put(t)
    assert _refcount(t) == 1
    q.close()
    q.join_thread()


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
@pytest.mark.parametrize("where", ["first", "inside"])
def test_a_forged_location_that_is_not_utf8_is_reported_as_the_error_it_causes(strategy, where):
    """A record naming a segment this process never mapped, at a location that is not
    UTF-8: the error is the open, connect or address failure quoting it escaped, not a
    UnicodeDecodeError raised while building the message (found by mutating records)."""
    prev = mp.get_sharing_strategy()
    mp.set_sharing_strategy(strategy)
    try:
        t = mp.zeros(10)
        good = records.share_tensor(t)
        data = bytearray(good)
        data[16:24] = (0x1234567890ABCDEF).to_bytes(8, "little")  # RecordHead.segment_id
        data[48:52] = (1).to_bytes(4, "little")  # owner_pid: not this process
        location_len = int.from_bytes(data[52:56], "little")
        data[-location_len if where == "first" else -3] = 0xFF  # the location ends the record
        with pytest.raises((OSError, ValueError)) as info:
            records.rebuild(bytes(data))
        assert not isinstance(info.value, UnicodeError)
        assert "\\xff" in str(info.value)
        records.release(good)
        assert _refcount(t) == 1
    finally:
        mp.set_sharing_strategy(prev)
