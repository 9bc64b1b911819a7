"""Test fixtures: the leak check every test runs under, and start-method parametrisation.

Every test must leave nothing behind: no new torch_mp_ext (or torch) segment in /dev/shm, no
new open fd, no child process (running or zombie). The check waits a few seconds for
children that are exiting, then fails the test naming what leaked.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time

import pytest

import torch_mp_ext

SHM_PREFIXES = ("torch_", "tmx_")
START_METHODS = ["fork", "spawn", "forkserver"]
LEAK_WAIT_S = 15.0


def shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIXES)}


def _creator_alive_elsewhere(name: str) -> bool:
    """True for torch_<pid>_... names of a live process other than this one: another
    program's segments (a concurrent test run), not this test's leak. A leaking child of
    this test is caught as a leftover process; a dead one's segments still count."""
    try:  # torch_<pid>_..., tmx_<pid>_..., and tests/_fuzz_worker.py's torch_fz<pid>_...
        pid = int(name.split("_")[1].removeprefix("fz"))
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _persistent_fds() -> set[str]:
    """fds of session-long helpers: the forkservers, the resource tracker, our fd server."""
    fds = {str(fd) for fd in torch_mp_ext.processes.forkserver.server_fds()}
    from multiprocessing import forkserver, resource_tracker

    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        fds.add(str(alive))
    tracker_fd = getattr(resource_tracker._resource_tracker, "_fd", None)
    if tracker_fd is not None:
        fds.add(str(tracker_fd))
    from multiprocessing import resource_sharer  # torch's fd strategy serves fds through it

    listener = getattr(resource_sharer._resource_sharer, "_listener", None)
    if listener is not None:
        fds.add(str(listener._listener._socket.fileno()))
    return fds


def open_fds() -> set[str]:
    """Open fds of this process, without the directory handle the listing itself uses."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own (already closed) directory fd
        if not target.startswith(f"/proc/{os.getpid()}/fd"):
            fds.add(name)
    return fds - _persistent_fds()


def _describe_fds(fds: set[str]) -> list[str]:
    out = []
    for fd in sorted(fds, key=int):
        try:
            out.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            out.append(f"{fd} (closed since)")
    return out


def child_pids() -> set[int]:
    """Processes whose parent is this one, zombies included, minus session-long helpers
    (the forkserver, the resource tracker, torch's torch_shm_manager)."""
    me = os.getpid()
    skip = set()
    from multiprocessing import forkserver, resource_tracker

    for pid in (
        torch_mp_ext.processes.forkserver.server_pid(),
        getattr(forkserver._forkserver, "_forkserver_pid", None),
        getattr(resource_tracker._resource_tracker, "_pid", None),
    ):
        if pid:
            skip.add(pid)
    kids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if "(torch_shm_manag" in stat:  # torch's fs-strategy daemon: lives with its clients
            continue
        if int(fields[1]) == me and int(entry) not in skip:
            kids.add(int(entry))
    return kids


@pytest.fixture(scope="session", autouse=True)
def _session_baseline():
    torch_mp_ext._C.fd_server_address()  # one listening socket per process, for good
    yield


@pytest.fixture(autouse=True)
def leak_check(request):
    """Fails a test that leaves segments, fds or processes behind."""
    if request.node.get_closest_marker("no_leak_check"):
        yield
        return
    shm_before, fds_before = shm_entries(), open_fds()
    yield
    deadline = time.monotonic() + LEAK_WAIT_S
    while True:
        multiprocessing.active_children()  # joins finished children of this test
        gc.collect()
        torch_mp_ext.empty_cache()
        new_shm = {n for n in shm_entries() - shm_before if not _creator_alive_elsewhere(n)}
        new_fds = open_fds() - fds_before
        kids = child_pids()
        if not (new_shm or new_fds or kids) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not kids, f"test left child processes behind: {sorted(kids)}"
    assert not new_shm, f"test left shared memory behind in /dev/shm: {sorted(new_shm)}"
    assert not new_fds, f"test left fds open: {_describe_fds(new_fds)}"


@pytest.fixture(params=START_METHODS)
def start_method(request) -> str:
    return request.param


@pytest.fixture
def ctx(start_method):
    return torch_mp_ext.get_context(start_method)


def pytest_configure(config):
    config.addinivalue_line("markers", "no_leak_check: the test checks leaks itself")
