"""The CUDA checks of torch_mp_ext, in one run, for a machine with a CUDA GPU.

Usage (from the repository root, after ``python setup.py build_ext --inplace`` on that machine,
or with a ``torch_mp_ext/_C*.so`` built for the same Python)::

    python tools/gpu_check.py [--budget 300] [--out DIR] [--skip-bench] [--repeats 7]

Sections, each skipped when the time budget (seconds, default 300) runs out:

1. PyTorch's CUDA cases of ``test/test_multiprocessing.py`` (2.13), rewritten here against
   ``torch_mp_ext`` (the file is not vendored; ``tools/run_torch_tests.py PATH`` runs the
   original when a checkout is at hand): simple sharing, producer deletes before the consumer
   reads, the learner/actor state_dict exchange without deadlock, 10,000 small tensors through
   a relay, interprocess events (through a queue, as a process argument, imported, exported),
   ``rebuild_cuda_tensor`` by keyword, empty/variable/parameter/mixed-dtype sharing,
   ``is_shared``, and CUDA in a forked child.
2. Forwarding: a received tensor sent on to a third process (values, writes, lifetime), and
   the error when its producer has exited.
3. Leaks: 10,000 sends; ``torch.cuda.memory_allocated`` back to its start on both sides, no
   counter file left.
4. Hand-off benchmark, 4 KB to 256 MB CUDA tensors, torch_mp_ext vs torch.multiprocessing in
   separate process pairs (the torch side never imports torch_mp_ext), interleaved, medians:
   from ``put()`` until the consumer has read the tensor's last element.

Results: a table on stdout, ``results.json`` and ``summary.md`` in ``--out`` (default ``$OUT``
when set, else ``gpu_check_out``). Exit status: 0 if every check that ran passed, 1 if one
failed, 3 if there is no GPU (nothing ran). About 3 minutes on one GPU.
``--device cpu --only bench`` runs the benchmark harness on CPU tensors (a harness check).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # never torch_mp_ext at module level: see _bench_side

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]
SEND_MANY = 10_000


def _tmx():
    import torch_mp_ext

    return torch_mp_ext


def _ctx():
    return _tmx().get_context("spawn")


# ---- child targets (module level: spawn imports this file as __mp_main__) ---------------


def simple_fill(q, done):
    _tmx()
    data = q.get(timeout=60)
    data[0][:] = 4
    torch.cuda.synchronize()  # torch's version omits this and races with the parent's read
    done.set()


def send_tensor(q, done, dtype):
    _tmx()
    t = torch.ones(5, 5, device="cuda", dtype=dtype)
    q.put(t)
    q.put(t)
    done.wait(60)


def send_and_delete_tensors(q, done, dtype, count, size=5):
    _tmx()
    for i in range(count):
        t = torch.full([size], i, device="cuda", dtype=dtype)
        q.put(t)
        del t
    done.wait(120)


def receive_and_send(q_in, q_out, count):
    _tmx()
    for _ in range(count):
        t = q_in.get(timeout=60)
        q_out.put(t.clone())
        del t


def receive_and_send_sum(q_in, q_out, done, count, size=5):
    _tmx()
    s = torch.zeros([size], device="cuda", dtype=torch.long)
    for _ in range(count):
        t = q_in.get(timeout=60)
        s += t
        del t
    q_out.put(s)
    done.wait(120)


def deadlock_actor(q, iterations):
    _tmx()
    for _ in range(iterations):
        if not q.empty():
            q.get()
        time.sleep(0.01)


def deadlock_learner(q, iterations):
    _tmx()
    net = torch.nn.LSTM(1, 1).cuda()
    for _ in range(iterations):
        if not q.full():
            q.put(copy.deepcopy(net.state_dict()))
        time.sleep(0.01)


def multiply_two(q, ready, done):
    _tmx()
    ready.set()
    with torch.cuda.stream(torch.cuda.Stream()):
        event, tensor = q.get(timeout=60)
        event.wait()
        tensor.mul_(2)
        event.record()
        done.set()
        del event


def event_child(event, p2c, c2p):
    _tmx()
    c2p.put(0)
    p2c.get()
    event.synchronize()
    c2p.put(1)


def event_importer(handle, p2c, c2p):
    _tmx()
    e1 = torch.cuda.Event.from_ipc_handle(0, handle)
    c2p.put(0)
    p2c.get()
    e1.synchronize()
    c2p.put(1)


def event_exporter(handle, p2c, c2p):
    _tmx()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        e1 = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), handle)
        torch.cuda._sleep(50_000_000)
        e1.record()
        c2p.put(0)
        p2c.get()  # keep the event alive until the parent synchronised


def share_torch_format(q, done):
    t = torch.arange(6, dtype=torch.float32, device="cuda")
    storage = t._typed_storage()
    dev, handle, nbytes, offset, ref, ref_offset, ev, sync = storage._share_cuda_()
    q.put({"tensor_cls": type(t), "tensor_size": t.size(), "tensor_stride": t.stride(),
           "tensor_offset": t.storage_offset(), "storage_cls": type(storage),
           "dtype": t.dtype, "storage_device": dev, "storage_handle": handle,
           "storage_size_bytes": nbytes, "storage_offset_bytes": offset,
           "requires_grad": False, "ref_counter_handle": ref, "ref_counter_offset": ref_offset,
           "event_handle": ev, "event_sync_required": sync})
    done.wait(60)


def echo_checks(q_in, q_out):
    """Receives items and answers facts about them (variable/parameter/empty sharing)."""
    _tmx()
    while True:
        item = q_in.get(timeout=60)
        if item is None:
            return
        q_out.put((type(item).__name__, item.requires_grad, item.grad is None, item.dtype,
                   item.is_cuda, item.numel(), float(item.float().sum()) if item.numel() else 0.0))
        del item


def queue_get_exception(q_in, q_out):
    try:
        torch.zeros(5, 5).cuda()
    except Exception as e:  # noqa: BLE001  (the error is the result)
        q_out.put(e)
    else:
        q_out.put("no exception")


def forward(q_in, q_out, done):
    _tmx()
    t = q_in.get(timeout=60)
    q_out.put(t)
    del t
    done.wait(60)


def read_write_hold(q_in, q_out, release):
    _tmx()
    t = q_in.get(timeout=60)
    q_out.put(float(t.sum()))
    t.fill_(7)
    torch.cuda.synchronize()
    q_out.put("written")
    release.wait(60)
    del t
    q_out.put("released")


def hold_then_forward(q_in, q_out, go):
    from multiprocessing.reduction import ForkingPickler

    _tmx()
    t = q_in.get(timeout=60)
    q_out.put("holding")
    go.wait(60)
    try:
        ForkingPickler.dumps(t)  # what any queue's put() does with it
    except RuntimeError as e:
        q_out.put(str(e))
    else:
        q_out.put("forwarded a tensor whose producer had exited")


def produce_and_exit(q):
    _tmx().cuda.set_exit_wait(0)
    q.put(torch.ones(10, device="cuda"))
    time.sleep(0.5)  # let the queue's feeder send it


def sum_and_drop(q_in, q_out, count):
    _tmx()
    torch.cuda.init()
    before = torch.cuda.memory_allocated()
    total = 0.0
    for _ in range(count):
        t = q_in.get(timeout=60)
        total += float(t[0])
        del t
    q_out.put((total, before, torch.cuda.memory_allocated()))


# ---- section 1: PyTorch's CUDA cases --------------------------------------------------------


def case_cuda_simple():
    ctx = _ctx()
    x = torch.zeros(5, 5, device="cuda")
    data = [x, x[:, 1]]
    q, done = ctx.Queue(), ctx.Event()
    q.put(data)
    p = ctx.Process(target=simple_fill, args=(q, done))
    p.start()
    assert done.wait(120), "the child never filled the tensors"
    assert data[0].eq(4).all() and data[1].eq(4).all()
    p.join(100)
    assert not p.is_alive()
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=send_tensor, args=(q, done, torch.float))
    p.start()
    t1, t2 = q.get(timeout=120), q.get(timeout=60)
    assert t1.eq(1).all()
    s1, s2 = t1.storage(), t2.storage()
    assert type(s1) is type(s2) and s1.data_ptr() == s2.data_ptr() and s1.tolist() == s2.tolist()
    del t1, t2, s1, s2
    done.set()
    p.join(100)
    assert not p.is_alive()


def case_cuda_memory_allocation():
    ctx = _ctx()
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=send_and_delete_tensors, args=(q, done, torch.int, 5))
    p.start()
    t = [q.get(timeout=120) for _ in range(5)]
    for i, x in enumerate(t):
        assert x.equal(torch.full([5], i, dtype=torch.int32, device="cuda"))
    del t, x
    done.set()
    p.join(10)
    assert p.exitcode == 0


def case_cuda_ipc_deadlock():
    ctx = _ctx()
    q = ctx.Queue(1)
    procs = [ctx.Process(target=deadlock_actor, args=(q, 100)),
             ctx.Process(target=deadlock_learner, args=(q, 100))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)  # torch joins for 10 s after start; spawn start-up is not counted here
    assert not any(p.is_alive() for p in procs), "learner/actor deadlocked"


def case_cuda_send_many():
    ctx = _ctx()
    q1, q2, q3 = ctx.Queue(), ctx.Queue(), ctx.Queue()
    e1, e3 = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=send_and_delete_tensors, args=(q1, e1, torch.long, SEND_MANY)),
             ctx.Process(target=receive_and_send, args=(q1, q2, SEND_MANY)),
             ctx.Process(target=receive_and_send_sum, args=(q2, q3, e3, SEND_MANY))]
    for p in procs:
        p.start()
    result = q3.get(timeout=240)
    assert result[0] == SEND_MANY * (SEND_MANY - 1) // 2, result
    del result
    e1.set()
    e3.set()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0, p.exitcode


def case_event():
    ctx = _ctx()
    q, ready, done = ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=multiply_two, args=(q, ready, done))
    p.start()
    assert ready.wait(120)
    with torch.cuda.stream(torch.cuda.Stream()):
        tensor = torch.ones(4, device="cuda")
        event = torch.cuda.Event(interprocess=True)
        torch.cuda._sleep(20_000_000)
        tensor.add_(1)
        event.record()
        q.put((event, tensor))
        assert done.wait(60)
        event.synchronize()
        assert tensor.tolist() == [4, 4, 4, 4]
    p.join(60)


def case_event_multiprocess():
    ctx = _ctx()
    event = torch.cuda.Event(enable_timing=False, interprocess=True)
    assert event.query()
    p2c, c2p = ctx.SimpleQueue(), ctx.SimpleQueue()
    p = ctx.Process(target=event_child, args=(event, p2c, c2p))
    p.start()
    c2p.get()
    torch.cuda._sleep(50_000_000)
    event.record()
    p2c.put(0)
    assert not event.query()
    c2p.get()
    assert event.query()
    p.join(60)


def case_event_handle_importer():
    ctx = _ctx()
    e0 = torch.cuda.Event(enable_timing=False, interprocess=True)
    assert e0.query()
    p2c, c2p = ctx.SimpleQueue(), ctx.SimpleQueue()
    p = ctx.Process(target=event_importer, args=(e0.ipc_handle(), p2c, c2p))
    p.start()
    c2p.get()
    torch.cuda._sleep(50_000_000)
    e0.record()
    p2c.put(0)
    assert not e0.query()
    c2p.get()
    assert e0.query()
    p.join(60)


def case_event_handle_exporter():
    ctx = _ctx()
    e0 = torch.cuda.Event(enable_timing=False, interprocess=True)
    p2c, c2p = ctx.SimpleQueue(), ctx.SimpleQueue()
    p = ctx.Process(target=event_exporter, args=(e0.ipc_handle(), p2c, c2p))
    p.start()
    c2p.get()
    assert not e0.query()  # recorded by the child behind a 50 ms kernel
    e0.synchronize()
    assert e0.query()
    p2c.put(1)
    p.join(60)


def case_rebuild_cuda_tensor():
    ctx = _ctx()
    mp = _tmx()
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=share_torch_format, args=(q, done))
    p.start()
    spec = q.get(timeout=120)
    t = mp.reductions.rebuild_cuda_tensor(**spec)  # torch's format, torch's keyword names
    assert t.tolist() == [0, 1, 2, 3, 4, 5]
    del t
    done.set()
    p.join(60)
    own = torch.arange(4, dtype=torch.float32, device="cuda")
    fn, args = mp.reductions.reduce_tensor(own)  # ours, by the same keywords
    names = ["tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls",
             "dtype", "storage_device", "storage_handle", "storage_size_bytes",
             "storage_offset_bytes", "requires_grad", "ref_counter_handle",
             "ref_counter_offset", "event_handle", "event_sync_required"]
    assert fn is mp.reductions.rebuild_cuda_tensor and len(args) == len(names)
    back = fn(**dict(zip(names, args)))
    assert back.untyped_storage()._cdata == own.untyped_storage()._cdata


def case_tensor_kinds():
    ctx = _ctx()
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=echo_checks, args=(q_in, q_out))
    p.start()
    leaf = torch.ones(3, device="cuda", requires_grad=True)
    leaf.grad = torch.ones(3, device="cuda")
    items = [
        (torch.empty(0, device="cuda"), ("Tensor", False, True, torch.float32, True, 0, 0.0)),
        (torch.empty(0, device="cuda", dtype=torch.int64),
         ("Tensor", False, True, torch.int64, True, 0, 0.0)),
        (leaf, ("Tensor", True, True, torch.float32, True, 3, 3.0)),
        (torch.nn.Parameter(torch.full((4,), 2.0, device="cuda")),
         ("Parameter", True, True, torch.float32, True, 4, 8.0)),
        (torch.nn.Parameter(torch.ones(2, dtype=torch.int64, device="cuda"),
                            requires_grad=False),
         ("Parameter", False, True, torch.int64, True, 2, 2.0)),
    ]
    block = torch.zeros(64, dtype=torch.uint8, device="cuda")  # mixed dtypes, one allocation
    block[:32].view(torch.float32).fill_(1.0)
    block[32:].fill_(3)
    items += [(block[:32].view(torch.float32), ("Tensor", False, True, torch.float32, True, 8,
                                                8.0)),
              (block[32:], ("Tensor", False, True, torch.uint8, True, 32, 96.0))]
    for item, expected in items:
        q_in.put(item)
        got = q_out.get(timeout=120)
        assert got == expected, (got, expected)
    q_in.put(None)
    p.join(60)
    assert torch.ones(2, device="cuda").is_shared()
    try:
        ctx.SimpleQueue().put(leaf * 2)  # SimpleQueue pickles in put(): the error is here
    except RuntimeError as e:
        assert "requires_grad" in str(e)
    else:
        raise AssertionError("a non-leaf tensor requiring grad was sent")


def case_cuda_bad_call():
    mp = _tmx()
    t = torch.zeros(5, 5).cuda().cpu()  # CUDA initialised in the parent
    ctx = mp.get_context("fork")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=queue_get_exception, args=(q_in, q_out))
    p.start()
    q_in.put(t)
    p.join(60)
    assert isinstance(q_out.get(timeout=10), RuntimeError)


# ---- section 2: forwarding --------------------------------------------------------------


def case_forwarding():
    ctx = _ctx()
    mp = _tmx()
    t = torch.full((1000,), 2.0, device="cuda")
    q_ab, q_bc, q_c = ctx.Queue(), ctx.Queue(), ctx.Queue()
    done_b, release_c = ctx.Event(), ctx.Event()
    b = ctx.Process(target=forward, args=(q_ab, q_bc, done_b))
    c = ctx.Process(target=read_write_hold, args=(q_bc, q_c, release_c))
    b.start()
    c.start()
    q_ab.put(t)
    assert q_c.get(timeout=120) == 2000.0
    assert q_c.get(timeout=60) == "written" and t.eq(7).all()
    done_b.set()
    b.join(60)
    assert b.exitcode == 0
    del t
    mp.cuda.ipc_collect()
    assert mp.cuda.ipc_stats()["lent_blocks"] == 1, "C's forwarded slot must keep A's block"
    release_c.set()
    assert q_c.get(timeout=60) == "released"
    c.join(60)
    mp.cuda.ipc_collect()
    assert mp.cuda.ipc_stats()["lent_blocks"] == 0


def case_forward_after_producer_exit():
    ctx = _ctx()
    q_a, q_out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    a = ctx.Process(target=produce_and_exit, args=(q_a,))
    b = ctx.Process(target=hold_then_forward, args=(q_a, q_out, go))
    a.start()
    b.start()
    assert q_out.get(timeout=120) == "holding"
    a.join(60)
    go.set()
    message = q_out.get(timeout=60)
    b.join(60)
    assert isinstance(message, str) and "has exited" in message and "Clone" in message, message


# ---- section 3: leaks -------------------------------------------------------------------


def case_send_10000_no_leak():
    ctx = _ctx()
    mp = _tmx()
    torch.cuda.init()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=sum_and_drop, args=(q_in, q_out, SEND_MANY))
    p.start()
    for i in range(SEND_MANY):
        q_in.put(torch.full((1024,), float(i), device="cuda"))  # 4 KB each
    total, c_before, c_after = q_out.get(timeout=240)
    p.join(60)
    assert total == sum(range(SEND_MANY)), total
    assert c_after == c_before, f"consumer memory_allocated {c_before} -> {c_after}"
    mp.cuda.ipc_collect()
    after = torch.cuda.memory_allocated()
    assert after == before, f"producer memory_allocated {before} -> {after}"
    stats = mp.cuda.ipc_stats()
    assert stats["lent_blocks"] == 0 and stats["counter_files"] == 0, stats
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{os.getpid()}_")]
    assert not left, f"counter files left: {left}"
    return {"producer_bytes_before": before, "producer_bytes_after": after,
            "consumer_bytes_before": c_before, "consumer_bytes_after": c_after,
            "released_blocks": stats["released_blocks"]}


CASES = [
    ("torch: cuda_simple", case_cuda_simple),
    ("torch: cuda_memory_allocation", case_cuda_memory_allocation),
    ("torch: cuda_ipc_deadlock", case_cuda_ipc_deadlock),
    (f"torch: cuda_send_many ({SEND_MANY})", case_cuda_send_many),
    ("torch: event", case_event),
    ("torch: event_multiprocess", case_event_multiprocess),
    ("torch: event_handle_importer", case_event_handle_importer),
    ("torch: event_handle_exporter", case_event_handle_exporter),
    ("torch: rebuild_cuda_tensor", case_rebuild_cuda_tensor),
    ("torch: empty/variable/parameter/mixed-type sharing", case_tensor_kinds),
    ("torch: cuda_bad_call", case_cuda_bad_call),
    ("forwarding A -> B -> C", case_forwarding),
    ("forwarding after the producer exited", case_forward_after_producer_exit),
    (f"leaks: {SEND_MANY} sends", case_send_10000_no_leak),
]


def run_case(name, fn):
    mp = _tmx()
    start = time.monotonic()
    try:
        detail = fn()
        status = "pass"
    except Exception:  # noqa: BLE001  (every failure is reported, the run goes on)
        status, detail = "FAIL", traceback.format_exc()
    for p in mp.active_children():  # nothing may outlive its case
        p.kill()
        p.join(10)
    return {"name": name, "status": status, "seconds": round(time.monotonic() - start, 2),
            "detail": detail}


# ---- section 4: the hand-off benchmark --------------------------------------------------


def _bench_lib(lib):
    if lib == "tmx":
        return _tmx()
    import torch.multiprocessing

    return torch.multiprocessing


def bench_consume(q, acks):
    while True:
        t = q.get()
        if t is None:
            return
        last = float(t.view(-1)[-1])  # waits for the sender's event, reads the memory
        acks.put((time.perf_counter(), last))
        del t
        acks.put("released")


def _bench_side(lib, device):
    """One side of the benchmark (a subprocess): answers trials read from stdin."""
    mp = _bench_lib(lib)
    ctx = mp.get_context("spawn")
    q, acks = ctx.SimpleQueue(), ctx.SimpleQueue()
    consumer = ctx.Process(target=bench_consume, args=(q, acks), daemon=True)
    consumer.start()
    print(json.dumps({"ready": lib}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "stop":
            break
        value = float(cmd["seq"] % 100 + 1)
        t = torch.full((cmd["nbytes"] // 4,), value, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        q.put(t)
        received, last = acks.get()
        assert acks.get() == "released"
        del t
        print(json.dumps({"seconds": received - start, "ok": last == value}), flush=True)
    q.put(None)
    consumer.join(60)


def run_bench(sizes, repeats, device, deadline):
    sides = {}
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for lib in ("torch", "tmx"):
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--bench-side",
                                 lib, "--device", device], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
        if not proc.stdout.readline():
            raise RuntimeError(f"benchmark side {lib} did not start ({proc.wait()})")
        sides[lib] = proc
    times, failures, seq, done_repeats = {}, [], 0, 0
    try:
        for rep in range(-1, repeats):  # round -1 warms up and is not counted
            if rep >= 1 and time.monotonic() > deadline:
                break
            for nbytes in sizes:
                for lib in ("torch", "tmx"):
                    seq += 1
                    proc = sides[lib]
                    proc.stdin.write(json.dumps({"op": "trial", "nbytes": nbytes,
                                                 "seq": seq}) + "\n")
                    proc.stdin.flush()
                    answer = json.loads(proc.stdout.readline())
                    if not answer["ok"]:
                        failures.append((lib, nbytes))
                    if rep >= 0:
                        times.setdefault((lib, nbytes), []).append(answer["seconds"])
            done_repeats = rep + 1
    finally:
        for proc in sides.values():
            try:
                proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                proc.stdin.close()
                proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
    rows = []
    for nbytes in sizes:
        torch_s = statistics.median(times[("torch", nbytes)])
        tmx_s = statistics.median(times[("tmx", nbytes)])
        rows.append({"nbytes": nbytes, "torch_s": torch_s, "tmx_s": tmx_s,
                     "ratio_torch_over_tmx": torch_s / tmx_s})
    return {"device": device, "repeats": done_repeats, "rows": rows, "failures": failures}


def _size(nbytes):
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _us(seconds):
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"


def bench_table(bench):
    lines = ["| size | torch.multiprocessing | torch_mp_ext | torch / tmx |", "|---|---|---|---|"]
    for r in bench["rows"]:
        lines.append(f"| {_size(r['nbytes'])} | {_us(r['torch_s'])} | {_us(r['tmx_s'])} | "
                     f"{r['ratio_torch_over_tmx']:.2f}x |")
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------


def environment():
    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info.update(cuda=torch.version.cuda, device=torch.cuda.get_device_name(0),
                    devices=torch.cuda.device_count())
    return info


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--only", choices=["cases", "bench"])
    parser.add_argument("--device", default="cuda", help="benchmark device (cpu: harness check)")
    parser.add_argument("--bench-side", choices=["torch", "tmx"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bench_side:
        return _bench_side(args.bench_side, args.device)
    deadline = time.monotonic() + args.budget
    os.makedirs(args.out, exist_ok=True)
    results = {"environment": environment(), "cases": [], "bench": None}
    print(json.dumps(results["environment"]), flush=True)
    try:
        _tmx()
    except ImportError as e:
        print(f"torch_mp_ext does not import ({e}): build it first with "
              "`python setup.py build_ext --inplace`", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if args.only != "bench":
        for name, fn in CASES:
            if not cuda:
                entry = {"name": name, "status": "skipped", "seconds": 0,
                         "detail": "no CUDA GPU"}
            elif time.monotonic() > deadline - 60:
                entry = {"name": name, "status": "skipped", "seconds": 0,
                         "detail": "time budget spent"}
            else:
                entry = run_case(name, fn)
            results["cases"].append(entry)
            print(f"{entry['status']:>7}  {entry['seconds']:6.1f} s  {name}", flush=True)
            if entry["status"] == "FAIL":
                print(entry["detail"], flush=True)
    if args.only != "cases" and not args.skip_bench and (cuda or args.device == "cpu"):
        results["bench"] = run_bench(SIZES, args.repeats, args.device, deadline)
        print(bench_table(results["bench"]), flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    summary = ["# tools/gpu_check.py", "", "```", json.dumps(results["environment"]), "```", ""]
    summary += [f"- {c['status']}: {c['name']} ({c['seconds']} s)" for c in results["cases"]]
    if results["bench"]:
        bench = results["bench"]
        summary += ["", f"Hand-off, median of {bench['repeats']} ({bench['device']}):", "",
                    bench_table(bench)]
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(summary) + "\n")
    failed = [c for c in results["cases"] if c["status"] == "FAIL"]
    failed += results["bench"]["failures"] if results["bench"] else []
    if failed:
        return 1
    if not cuda and results["bench"] is None:
        print("no CUDA GPU here: nothing was checked", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
