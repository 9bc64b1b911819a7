"""Tensors, storages and arrays through the reducers, in one process and across processes."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from multiprocessing.reduction import ForkingPickler

import _workers
import numpy as np
import pytest
import torch

import torch_mp_ext as mp
from torch_mp_ext.sharing.memory import _numpy_min_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    torch.bool, torch.float8_e4m3fn,
]


def round_trip(obj):
    return pickle.loads(ForkingPickler.dumps(obj))


@pytest.fixture(params=["file_descriptor", "file_system"])
def strategy(request):
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy(request.param)
    yield request.param
    mp.set_sharing_strategy(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_and_shares(strategy, dtype):
    t = torch.arange(24).reshape(4, 6).to(dtype)
    u = round_trip(t)
    assert u.dtype == dtype and u.shape == t.shape
    assert torch.equal(u.view(torch.uint8), t.view(torch.uint8))
    assert u.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # moved in place


def test_views_and_non_contiguous_keep_layout(strategy):
    base = torch.arange(60.0).reshape(5, 12)
    views = [base[1:4], base[:, 3], base.t(), base[::2, ::3], base[2, 5:6]]
    out = round_trip(views)
    for a, b in zip(views, out):
        assert torch.equal(a, b)
        assert a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
    out[1][0] = -1.0
    assert base[0, 3] == -1.0


def test_same_storage_rebuilds_as_one_storage_and_same_process_identity(strategy):
    x = torch.randn(5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage deprecation
        data = [x.storage(), x, x[2], x[:, 1]]
        new = round_trip(data)
        cdata = data[0]._cdata
        assert new[0]._cdata == cdata
        assert all(t.storage()._cdata == cdata for t in new[1:])


@pytest.mark.parametrize("make", [
    lambda: torch.arange(6.0).to(torch.complex128).storage(),      # TypedStorage
    lambda: torch.ComplexDoubleStorage(4),                            # a legacy class
], ids=["typed", "legacy-class"])
def test_typed_storages_round_trip_through_our_rebuild_and_share(strategy, make):
    """Typed storages rebuild through torch_mp_ext's rebuild_typed_storage(_child), which
    checks alignment (test_hostile forges the offset), and still share their memory."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage deprecation
        s = make()
        payload = bytes(ForkingPickler.dumps(s))
        assert b"torch_mp_ext.reductions" in payload and b"rebuild_typed_storage" in payload
        u = pickle.loads(payload)
        assert type(u) is type(s) and u.dtype == s.dtype and u.size() == s.size()
        assert u.data_ptr() == s.data_ptr()  # moved in place, then shared
        u.fill_(3)
        assert s.tolist() == [3] * s.size()


def test_empty_meta_and_requires_grad(strategy):
    for t in (torch.empty(0), torch.empty(0, 3, dtype=torch.int64), torch.tensor([])):
        u = round_trip(t)
        assert u.shape == t.shape and u.dtype == t.dtype
    meta = torch.empty(3, 4, device="meta")
    assert round_trip(meta).shape == (3, 4) and round_trip(meta).device.type == "meta"
    leaf = torch.ones(3, requires_grad=True)
    leaf.grad = torch.ones(3)
    u = round_trip(leaf)
    assert u.requires_grad and u.grad is None


def test_parameter_stays_a_parameter_and_int_parameter_works(strategy):
    p = torch.nn.Parameter(torch.ones(2, 2))
    u = round_trip(p)
    assert type(u) is torch.nn.Parameter and u.requires_grad
    ip = torch.nn.Parameter(torch.arange(3), requires_grad=False)
    assert type(round_trip(ip)) is torch.nn.Parameter


def test_non_leaf_refusal_has_torchs_message():
    t = torch.ones(2, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="Cowardly refusing to serialize non-leaf tensor"):
        ForkingPickler.dumps(t)


def test_sparse_coo_and_csr(strategy):
    coo = torch.sparse_coo_tensor([[0, 1, 2], [2, 0, 1]], [1.0, 2.0, 3.0], (3, 3))
    assert torch.equal(round_trip(coo).to_dense(), coo.to_dense())
    csr = torch.eye(4).to_sparse_csr()
    out = round_trip(csr)
    assert out.layout == torch.sparse_csr and torch.equal(out.to_dense(), torch.eye(4))


def test_resizing_a_shared_storage_raises_instead_of_crashing(strategy):
    t = torch.ones(10)
    round_trip(t)
    with pytest.raises(RuntimeError, match="not resizable"):
        t.untyped_storage().resize_(1000)
    with pytest.raises(RuntimeError, match="not resizable"):
        mp.empty(10).untyped_storage().resize_(1000)


@pytest.mark.no_leak_check  # torch's file_system manager keeps a socket for the session
def test_storages_shared_by_torch_keep_torchs_handles(strategy):
    import os

    from conftest import shm_entries

    mine = f"torch_{os.getpid()}_"
    before = {n for n in shm_entries() if n.startswith(mine)}
    t = torch.arange(10.0).share_memory_()
    u = round_trip(t)
    assert u.untyped_storage().is_shared() and torch.equal(u, t)
    assert u.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    del t, u
    assert {n for n in shm_entries() if n.startswith(mine)} - before == set()


def test_numpy_arrays(strategy):
    small = np.arange(10)
    out = round_trip(small)
    assert np.array_equal(out, small) and not mp.is_shared(out)  # small: by value
    big = np.arange(100_000, dtype=np.float64)[::-2]  # negative stride, non-contiguous
    out = round_trip(big)
    assert np.array_equal(out, big) and mp.is_shared(out)
    born = mp.empty_array((300, 7), np.int32)
    born[...] = 3
    view = born[::3, 2:5]
    out = round_trip(view)
    assert out.strides == view.strides and np.array_equal(out, view)
    out[0, 0] = 99
    assert born[0, 2] == 99  # zero-copy: the same pages
    assert round_trip(np.array(["a", None], dtype=object)).tolist() == ["a", None]


_NUMPY_OFF_SCRIPT = """
import pickle, sys
from multiprocessing.reduction import ForkingPickler
import numpy as np
import torch_mp_ext as mp
big = np.arange(100_000, dtype=np.float64)
data = bytes(ForkingPickler.dumps(big))
assert len(data) > big.nbytes, len(data)  # by value, as the standard library pickles it
assert not mp.is_shared(pickle.loads(data))
born = mp.empty_array((100_000,), np.float64)
assert len(bytes(ForkingPickler.dumps(born))) < 1000  # born in shared memory: a handle
print("ok")
"""


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, **env)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                          text=True, timeout=120)


def test_numpy_min_bytes_off_keeps_the_standard_librarys_pickling():
    """TORCH_MP_EXT_NUMPY_MIN_BYTES=off (docs/migration.md): the import's numpy reducer
    pickles ordinary arrays by value; a malformed value is refused, naming both spellings."""
    done = _python(_NUMPY_OFF_SCRIPT, TORCH_MP_EXT_NUMPY_MIN_BYTES="off")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert _numpy_min_bytes(" OFF ") == sys.maxsize and _numpy_min_bytes("65536") == 65536
    with pytest.raises(ValueError, match="TORCH_MP_EXT_NUMPY_MIN_BYTES='64k' is neither a "
                                         "size in bytes nor 'off'"):
        _numpy_min_bytes("64k")


@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
def test_writes_are_seen_both_ways_across_processes(ctx, strategy_name):
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy(strategy_name)
    try:
        q_in, q_out = ctx.Queue(), ctx.Queue()
        x = torch.zeros(5, 5)
        arr = mp.empty_array((4, 4), np.float32)
        arr[...] = 0
        p = ctx.Process(target=_workers.fill_and_ack, args=(q_in, q_out, 4))
        p.start()
        q_in.put([x, x[:, 1], arr])
        assert q_out.get(timeout=60) == "done"
        p.join(60)
        assert p.exitcode == 0
        assert x.eq(4).all() and (arr == 4).all()
        q_in.close(), q_out.close()
        q_in.join_thread(), q_out.join_thread()
    finally:
        mp.set_sharing_strategy(before)


def test_child_sends_same_tensor_twice_parent_gets_one_storage(ctx):
    q, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_workers.send_tensor_twice, args=(q, e))
    p.start()
    t1, t2 = q.get(timeout=60), q.get(timeout=60)
    assert t1.eq(1).all()
    assert t1.untyped_storage().data_ptr() == t2.untyped_storage().data_ptr()
    del t1, t2
    e.set()
    p.join(60)
    assert p.exitcode == 0
    q.close()
    q.join_thread()


def test_numpy_zero_copy_both_ways(ctx):
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_workers.array_round_trip, args=(q_in, q_out))
    p.start()
    arr = mp.empty_array((256, 256), np.float32)
    arr[...] = 1
    q_in.put(arr)
    back, born_in_child = q_out.get(timeout=60)
    assert (arr == 2).all() and (back == 2).all()  # the child's += 1 landed in our pages
    assert (born_in_child == 4).all() and mp.is_shared(born_in_child)
    back[0, 0] = 7
    assert arr[0, 0] == 7
    del back, born_in_child
    q_in.put("done")
    p.join(60)
    assert p.exitcode == 0
    for q in (q_in, q_out):
        q.close()
        q.join_thread()


def test_torch_multiprocessing_and_dataloader_still_work_in_this_process():
    import torch.multiprocessing as torch_mp
    from torch.utils.data import DataLoader, TensorDataset

    q = torch_mp.get_context("fork").SimpleQueue()
    t = torch.arange(6.0)
    q.put(t)
    assert torch.equal(q.get(), t)
    q.close()
    data = TensorDataset(torch.arange(64.0).reshape(32, 2))
    loader = DataLoader(data, batch_size=8, num_workers=2, multiprocessing_context="fork")
    batches = [b[0] for b in loader]
    assert torch.equal(torch.cat(batches), data.tensors[0])
