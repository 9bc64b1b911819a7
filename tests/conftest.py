"""Test fixtures: the two tiers, the hang protection, the leak check every test runs under,
and start-method parametrisation.

Tiers. ``python -m pytest -q`` runs the fast tier: every test not marked ``slow``. With
``--slow`` it runs the slow tier instead: the tests marked ``slow`` (spawn variants, the
CPython suites, long kill-anywhere and fuzz runs, benchmark smoke tests, the rest of the docs
examples). Both commands together are the full suite; a test marked ``every_tier`` runs in
both. A test that is slow for a reason says so at its ``pytest.mark.slow`` (or, for a
parametrisation, at its ``pytest.param``); one rule lives here: ``is_spawn_variant``.

Nothing hangs. Three layers, each for what the one before cannot reach:

1. pytest-timeout (``timeout`` in pyproject.toml; ``SLOW_TIMEOUT_S`` for slow tests) raises a
   failure in the test from SIGALRM, with every thread's stack. SIGALRM, not SIGINT: a run
   started as a background job of a script ignores SIGINT, and ``_thread.interrupt_main()``
   then does nothing.
2. ``BACKSTOP_GRACE_S`` later, if the test still runs (its main thread blocked in C code,
   waiting on a child), a watchdog thread SIGKILLs every process below this one: whatever
   the test waits on dies, the wait returns and the failure from (1) is raised.
3. Another ``BACKSTOP_GRACE_S`` later, faulthandler's C-level watchdog, which needs no GIL,
   dumps every thread's stack and exits the run with status 1.

Leaks. Every test must leave nothing behind: no new torch_mp_ext (or torch) segment in
/dev/shm, no new open fd, no child process (running or zombie). The check costs a few
listings when nothing leaked; only when something looks leaked does it collect garbage
(an object in a reference cycle may still hold a segment or an fd) and wait up to
``LEAK_WAIT_S`` for children that are exiting. It then fails the test naming what leaked,
and kills the leftover processes (and theirs) so the next test starts clean.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import multiprocessing
import os
import signal
import sys
import threading
import time

import pytest

import torch_mp_ext

SHM_PREFIXES = ("torch_", "tmx_")
START_METHODS = ["fork", "spawn", "forkserver"]
LEAK_WAIT_S = float(os.environ.get("TMX_TEST_LEAK_WAIT_S", "15"))  # for exiting children
SLOW_TIMEOUT_S = 900.0  # a slow test's timeout (the fast tier's is `timeout` in pyproject.toml)
# After a test's timeout: kill its processes; as much again: exit. The variable is for
# tests/test_harness.py, which proves the layers in a run of its own.
BACKSTOP_GRACE_S = float(os.environ.get("TMX_TEST_BACKSTOP_GRACE_S", "30"))


def shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIXES)}


def creator_pid(name: str) -> int | None:
    """The creator's pid in a torch_<pid>_... or tmx_<pid>_... name (torch_fz<pid>_...: the
    fuzz worker's), or None."""
    try:
        return int(name.split("_")[1].removeprefix("fz"))
    except (IndexError, ValueError):
        return None


def _creator_alive_elsewhere(name: str) -> bool:
    """True for names of a live process other than this one (``creator_pid``): another
    program's segments (a concurrent test run), not this test's leak. A leaking child of
    this test is caught as a leftover process; a dead one's segments still count."""
    pid = creator_pid(name)
    if pid is None:
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


def _processes() -> dict[int, tuple[int, str]]:
    """Every live process: pid -> (parent pid, its /proc stat line), read once from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        found[int(entry)] = (int(stat[stat.rindex(")") + 2 :].split()[1]), stat)
    return found


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
    # "(torch_shm_manag": torch's fs-strategy daemon lives with its clients.
    return {pid for pid, (ppid, stat) in _processes().items()
            if ppid == me and pid not in skip and "(torch_shm_manag" not in stat}


@pytest.fixture(scope="session", autouse=True)
def _session_baseline():
    torch_mp_ext._C.fd_server_address()  # one listening socket per process, for good
    _libuv_global_pipe()
    yield


def _libuv_global_pipe() -> None:
    """torch's TCPStore (libuv) makes one pipe the first time a process runs one, kept for the
    process's life: made here, before any leak check, since launch() runs elastic's agent,
    and so a TCPStore, in the test process."""
    import datetime

    import torch.distributed as dist

    if dist.is_available():
        store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=30))
        del store


def _leaks(shm_before: set[str], fds_before: set[str]):
    """What the running test has left so far: (new shm names, new fds, child pids)."""
    multiprocessing.active_children()  # joins finished children of this test
    torch_mp_ext.empty_cache()
    new_shm = {n for n in shm_entries() - shm_before if not _creator_alive_elsewhere(n)}
    return new_shm, open_fds() - fds_before, child_pids()


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (children, their children, ...), from /proc."""
    parent_of = {pid: ppid for pid, (ppid, _) in _processes().items()}
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parent_of.items() if ppid in frontier} - found
        found |= frontier
    return found


def kill_tree(pids: set[int]) -> None:
    """SIGKILLs ``pids`` and everything below them, then reaps those that are our children."""
    victims = set(pids)
    for pid in pids:
        victims |= descendants(pid)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    multiprocessing.active_children()  # lets multiprocessing reap the ones it started
    for pid in victims:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # reaped above, or not our child (its parent reaps it)
            pass


@pytest.fixture(autouse=True)
def leak_check(request):
    """Fails a test that leaves segments, fds or processes behind (and kills the processes)."""
    if request.node.get_closest_marker("no_leak_check"):
        yield
        return
    shm_before, fds_before = shm_entries(), open_fds()
    yield
    new_shm, new_fds, kids = _leaks(shm_before, fds_before)
    deadline = time.monotonic() + LEAK_WAIT_S
    generation = 1  # the test's own garbage is young: collecting it takes a millisecond
    while new_shm or new_fds or kids:
        # Something looks leaked. Garbage in a reference cycle may still hold it (a segment,
        # an fd), or a child may be exiting: collect, and look again until the deadline. A
        # full collection (~50-100 ms with torch's heap) only if the young one was not enough.
        gc.collect(generation)
        generation = 2
        # A block of a SIGKILLed owner's segment that this collection freed leaves an idle
        # mapping only empty_cache() drops (Note [Idle mappings of a gone owner] in
        # csrc/shm/registry.h): a test's own empty_cache() may have run before the block went.
        tmx = sys.modules.get("torch_mp_ext")
        if tmx is not None:
            tmx.empty_cache()
        new_shm, new_fds, kids = _leaks(shm_before, fds_before)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if kids:
        kill_tree(kids)
    assert not kids, f"test left child processes behind: {sorted(kids)}"
    assert not new_shm, f"test left shared memory behind in /dev/shm: {sorted(new_shm)}"
    assert not new_fds, f"test left fds open: {_describe_fds(new_fds)}"


@pytest.fixture(params=START_METHODS)
def start_method(request) -> str:
    return request.param


@pytest.fixture
def ctx(start_method):
    return torch_mp_ext.get_context(start_method)


# ---- tiers ---------------------------------------------------------------------------------


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="run the slow tier (tests marked slow) instead of the fast tier")


def pytest_configure(config):
    global _stderr_fd
    config.addinivalue_line("markers", "no_leak_check: the test checks leaks itself")
    config.addinivalue_line("markers", "every_tier: runs in the fast and the slow tier")
    _stderr_fd = os.dup(2)  # output capture is suspended here: fd 2 is the terminal's


#: Parameters that choose a start method. A parametrised test's "spawn" variant is in the
#: slow tier: spawn workers import torch afresh (2-4 s each on 2 CPUs), and the test's fork
#: and forkserver variants cover the same code in the fast tier. Tests that only make sense
#: under spawn are not parametrised and stay where their own mark puts them.
START_METHOD_PARAMS = ("start_method", "method")


def is_spawn_variant(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(params.get(name) == "spawn" for name in START_METHOD_PARAMS)


def pytest_collection_modifyitems(config, items):
    """Keeps the chosen tier's tests (deselecting the other's) and gives slow tests their
    longer timeout."""
    slow_tier = config.getoption("--slow")
    cli_timeout = config.getoption("timeout", None)
    keep, drop = [], []
    for item in items:
        if is_spawn_variant(item) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
        slow = item.get_closest_marker("slow") is not None
        every = item.get_closest_marker("every_tier") is not None
        (keep if every or slow == slow_tier else drop).append(item)
        # A --timeout on the command line is for every test (0: none, for a long fuzz run).
        if slow and item.get_closest_marker("timeout") is None and cli_timeout is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# ---- hang protection (layers 2 and 3; layer 1 is pytest-timeout) ----------------------------


def _timeout_of(item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    if marker is not None and "timeout" in marker.kwargs:
        return float(marker.kwargs["timeout"])
    option = item.config.getoption("timeout", None)  # --timeout on the command line
    if option is None:
        option = item.config.getini("timeout")
    return float(option or 0)


class _Backstop:
    """One daemon thread that SIGKILLs every process below this one when the armed test
    outlives its deadline (layer 2 of the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: tuple[str, float] | None = None  # (test id, monotonic deadline)
        threading.Thread(target=self._run, name="tmx-test-backstop", daemon=True).start()

    def arm(self, nodeid: str, seconds: float) -> None:
        with self._cond:
            self._armed = (nodeid, time.monotonic() + seconds)
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._armed = None
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._armed is None or time.monotonic() < self._armed[1]:
                    wait = None if self._armed is None else self._armed[1] - time.monotonic()
                    self._cond.wait(wait)
                nodeid, self._armed = self._armed[0], None
            victims = descendants(os.getpid())
            os.write(_stderr_fd, f"\n{nodeid}: still running {BACKSTOP_GRACE_S:.0f} s past its "
                                 f"timeout; SIGKILL to every process below the run: "
                                 f"{sorted(victims)}\n".encode())
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


_backstop: _Backstop | None = None
_stderr_fd = 2  # a copy of the run's real stderr, made before output capture (pytest_configure)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _backstop
    timeout = _timeout_of(item)
    if timeout <= 0:
        yield
        return
    if _backstop is None:
        _backstop = _Backstop()
    _backstop.arm(item.nodeid, timeout + BACKSTOP_GRACE_S)
    # Layer 3: C-level, needs no GIL; dumps every thread's stack and ends the run.
    faulthandler.dump_traceback_later(timeout + 2 * BACKSTOP_GRACE_S, exit=True,
                                      file=_stderr_fd)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        _backstop.disarm()


@contextlib.contextmanager
def memory_limited_cgroup(name: str, limit: int = 64 << 20):
    """A cgroup v1 memory cgroup of this test's own under ours, limited to ``limit`` bytes,
    removed after (waiting up to 10 s for its last process to go); skips the test where no
    writable memory controller is mounted (an OOM kill must not reach anything else)."""
    parent = None
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.strip().split(":", 2)
                if "memory" in controllers.split(","):
                    directory = f"/sys/fs/cgroup/{controllers}{path}"
                    parent = directory if os.access(directory, os.W_OK) else None
                    break
    except OSError:
        pass
    if parent is None:
        pytest.skip("needs a writable cgroup v1 memory controller to make an OOM kill safely")
    cgroup = os.path.join(parent, f"{name}-{os.getpid()}")
    try:
        os.mkdir(cgroup)
        with open(os.path.join(cgroup, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
    except OSError as e:
        pytest.skip(f"cannot make a memory-limited cgroup here: {e}")
    try:
        yield cgroup
    finally:
        deadline = time.monotonic() + 10
        while os.path.exists(cgroup):
            try:
                os.rmdir(cgroup)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

