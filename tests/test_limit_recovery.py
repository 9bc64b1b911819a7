"""After a resource limit is hit and what filled it is let go, work goes on (issue 35 D3, D4):
Note [A server at its fd limit] in csrc/ipc/fd_server.cpp and Note [Idle mappings under a
limit] in csrc/shm/registry.cpp. Real limits (setrlimit) in forked processes."""

from __future__ import annotations

import gc
import resource

import torch

import torch_mp_ext as mp

T = 60.0
BIG = 300_000  # past the slab classes: one anonymous segment (one fd) per tensor


def _sender_until_the_fd_limit(q, acks):
    mp.set_sharing_strategy("file_descriptor")
    q.put(mp.zeros(10))  # the fd server runs before the limit is lowered
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    sent = 0
    try:
        while True:
            t = mp.empty(BIG, dtype=torch.uint8).fill_(sent % 251)
            q.put(t)
            del t
            sent += 1
    except OSError as e:
        q.put(("full", sent, str(e)))
    acks.get(timeout=T)  # the consumer took and dropped everything
    again = [mp.empty(BIG, dtype=torch.uint8) for _ in range(8)]
    q.put(("again", len(again)))
    acks.get(timeout=T)


def test_a_sender_at_its_fd_limit_allocates_again_once_its_tensors_are_dropped():
    ctx = mp.get_context("fork")
    q, acks = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_sender_until_the_fd_limit, args=(q, acks))
    p.start()
    try:
        assert q.get(timeout=T).shape == (10,)
        got = 0
        while True:
            item = q.get(timeout=T)
            if isinstance(item, tuple):
                break
            assert item.shape == (BIG,) and int(item[0]) == got % 251
            got += 1
            del item
        tag, sent, message = item
        assert tag == "full" and sent == got and sent > 10, item
        assert "RLIMIT_NOFILE=64" in message, message
        acks.put("dropped")
        assert q.get(timeout=T) == ("again", 8)
        acks.put("done")
    finally:
        p.join(T)
        q.close()
        acks.close()
    assert p.exitcode == 0


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _receiver_under_rlimit_as(q, out):
    mib64 = 64 << 20
    gc.collect()
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + 6 * mib64, resource.RLIM_INFINITY))
    held, errors = [], []
    for _ in range(12):  # more than fit: the first ones fill the address space
        try:
            held.append(q.get(timeout=T))
        except OSError as e:
            errors.append(str(e))
    n_held = len(held)
    del held
    gc.collect()
    again = 0
    for _ in range(4):  # idle mappings of a live owner must not block new ones (no
        # empty_cache(): the failed map drops them and retries by itself)
        t = q.get(timeout=T)
        again += int(t.shape == (mib64,))
        del t
    out.put((n_held, len(errors), errors[:1], again))


def test_a_receiver_at_its_address_space_limit_receives_again():
    ctx = mp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_receiver_under_rlimit_as, args=(q, out))
    p.start()
    try:
        for _ in range(16):  # 16 distinct live 64 MB segments: nothing is recycled
            q.put(mp.empty(64 << 20, dtype=torch.uint8))
        n_held, n_errors, errors, again = out.get(timeout=T)
    finally:
        p.join(T)
        q.close()
        out.close()
    assert p.exitcode == 0
    assert 3 <= n_held < 12 and n_errors > 0, (n_held, n_errors, errors)
    assert "ENOMEM" in errors[0] or "memory" in errors[0], errors
    assert again == 4, (again, errors)
