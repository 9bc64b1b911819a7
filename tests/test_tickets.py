"""A handle is spent once (Note [Tickets] in csrc/shm/layout.h).

Loading the same pickled bytes twice, in the owner or in another process, must never drop a
reference someone else holds: the second load raises ``CorruptSegmentError``, and the block
stays with its tensor (64 fresh allocations of its size never land on it).
"""

from __future__ import annotations

import pickle
import threading
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

import torch_mp_ext as mp
from torch_mp_ext import _C
from torch_mp_ext.errors import CorruptSegmentError
from torch_mp_ext.sharing import records

T = 30.0
KINDS = ["tensor", "typed_storage", "ndarray", "record"]


@pytest.fixture(params=["file_descriptor", "file_system"])
def strategy(request):
    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy(request.param)
    yield request.param
    mp.set_sharing_strategy(old)


def _make(kind):
    """(the original, its bytes, the function that loads them, its data pointer)."""
    if kind == "ndarray":
        a = mp.zeros_array(1024, dtype=np.float32)
        return a, bytes(ForkingPickler.dumps(a)), pickle.loads, a.ctypes.data
    t = mp.zeros(1024)
    if kind == "tensor":
        return t, bytes(ForkingPickler.dumps(t)), pickle.loads, t.data_ptr()
    if kind == "typed_storage":
        s = t.storage()
        return t, bytes(ForkingPickler.dumps(s)), pickle.loads, t.data_ptr()
    return t, records.share_tensor(t), records.rebuild, t.data_ptr()


def _check_untouched(original, address):
    """64 fresh allocations of the original's size never overlap it, and writing them leaves
    it as it was."""
    fresh = [mp.zeros(1024) for _ in range(64)]
    assert address not in {f.data_ptr() for f in fresh}
    for f in fresh:
        f.fill_(7)
    assert float(torch.as_tensor(original).abs().sum()) == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_loading_the_same_bytes_twice_in_the_owner_raises(strategy, kind):
    original, data, load, address = _make(kind)
    first = load(data)
    with pytest.raises(CorruptSegmentError, match="spent handle"):
        load(data)
    del first
    _check_untouched(original, address)


def _load_twice(conn, kind):
    data = conn.recv_bytes()
    load = records.rebuild if kind == "record" else pickle.loads
    first = load(data)
    try:
        load(data)
        conn.send("loaded twice")
    except CorruptSegmentError as e:
        conn.send(f"raised: {e}")
    del first


@pytest.mark.parametrize("kind", KINDS)
def test_loading_the_same_bytes_twice_in_a_receiver_raises(strategy, kind):
    ctx = mp.get_context("fork")
    original, data, _, address = _make(kind)
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_load_twice, args=(child, kind))
    p.start()
    try:
        parent.send_bytes(data)
        assert parent.poll(T)
        answer = parent.recv()
        assert answer.startswith("raised:") and "spent handle" in answer, answer
    finally:
        p.join(T)
        parent.close()
        child.close()
    assert p.exitcode == 0
    # The receiver exited and dropped the one reference it took: the original keeps its own.
    _check_untouched(original, address)


def test_a_handle_given_back_twice_raises(strategy):
    t = mp.zeros(1024)
    handle = _C.share_address(t.data_ptr(), t.untyped_storage().nbytes())[0]
    _C.release_handle(handle)
    with pytest.raises(CorruptSegmentError, match="spent handle"):
        _C.release_handle(handle)
    _check_untouched(t, t.data_ptr())


def test_a_handle_with_the_wrong_secret_is_refused():
    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_descriptor")
    try:
        t = mp.zeros(1024)
        handle = list(_C.share_address(t.data_ptr(), t.untyped_storage().nbytes())[0])
        real = tuple(handle)
        handle[2] ^= 1  # the secret
        with pytest.raises(CorruptSegmentError, match="wrong secret"):
            _C.release_handle(tuple(handle))
        with pytest.raises(CorruptSegmentError, match="wrong secret"):
            _C.attach(tuple(handle))
        _C.release_handle(real)  # the real one still counts, once
        _check_untouched(t, t.data_ptr())
    finally:
        mp.set_sharing_strategy(old)


def test_a_stale_handle_is_not_released():
    t = mp.zeros(1024)
    handle = _C.share_address(t.data_ptr(), t.untyped_storage().nbytes())[0]
    _C.release_handle(handle)
    address = t.data_ptr()
    del t
    again = mp.zeros(1024)  # the block's next generation (the pool hands it out again)
    assert again.data_ptr() == address
    with pytest.raises(CorruptSegmentError, match="stale handle"):
        _C.release_handle(handle)
    _check_untouched(again, address)


def test_an_attach_racing_the_last_unmap_uses_the_live_mapping():
    """Note [One critical section per lookup]: a thread attaching a handle while another drops
    the last local reference and empties the cache (unmapping the segment) ends with a mapping
    the registry knows;
    the hook widens the window between the lookup and its use to 200 ms."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_race_in_receiver, args=(child,))
    p.start()
    try:
        t = mp.zeros(1024)
        s = mp.zeros(1024)  # same segment: the receiver maps it once for both
        parent.send_bytes(bytes(ForkingPickler.dumps(t)))
        parent.send_bytes(bytes(ForkingPickler.dumps(s)))
        assert parent.poll(T)
        assert parent.recv() == "ok"
    finally:
        p.join(T)
        parent.close()
        child.close()
    assert p.exitcode == 0
    _check_untouched(t, t.data_ptr())


def _race_in_receiver(conn):
    first = pickle.loads(conn.recv_bytes())
    data = conn.recv_bytes()
    _C._set_attach_delay(200)
    got = {}
    worker = threading.Thread(target=lambda: got.setdefault("t", pickle.loads(data)))
    worker.start()
    threading.Event().wait(0.05)  # the worker has found the mapping and sleeps in the hook
    del first  # the last local reference: the mapping turns idle
    mp.empty_cache()  # and goes, while the worker still holds what its lookup returned
    worker.join(T)
    _C._set_attach_delay(0)
    second = got["t"]
    stats = _C.arena_stats()
    ok = float(second.sum()) == 0.0 and stats["mapped_segments"] >= 1 and not _C.audit(False)
    conn.send("ok" if ok else f"bad: {stats} {_C.audit(False)}")
    del second
