"""Refusing up front what shared memory can never hold (issue 35, D2).

Note [Requests beyond memory]
A segment is ``posix_fallocate``d in full when it is made (Note [Segment layout] in
``csrc/shm/segment.h``), so that a full ``/dev/shm`` is an error instead of a SIGBUS later.
For a request larger than memory that is the wrong trade: reserving 4 TiB on a 23 GiB
machine has the kernel's OOM killer fire (possibly at unrelated processes) long before
``fallocate`` could fail. So a request is first compared with what could ever hold it: the
machine's RAM plus swap (``/proc/meminfo``), the limits of this process's memory cgroups
(v2 ``memory.max`` plus ``memory.swap.max``; v1 ``memory.memsw.limit_in_bytes``, else
``memory.limit_in_bytes`` plus swap; each ancestor too), and for the ``file_system``
strategy the size of ``/dev/shm``. Past the smallest of them it raises
:class:`~torch_mp_ext.errors.SharedMemoryLimitError` at once, with nothing reserved. This is a
bound on one request, not an admission control: requests under it may still meet a full
``/dev/shm`` (``SharedMemoryError``) or the OOM killer when many of them add up, as with
``torch.empty``. The machine's and cgroups' limits are read once per process (fixed for its
life in practice); ``/dev/shm``'s size at each named request of 64 MiB or more (one
``statvfs``); smaller requests are not checked.
"""

from __future__ import annotations

import errno
import functools
import os

from ..errors import SharedMemoryLimitError

__all__ = ["check_request", "cgroup_memory_dirs"]

_UNLIMITED = 1 << 62
#: Requests this small are not checked (any machine holds them; a smaller /dev/shm answers
#: ENOSPC when the segment is reserved): the hot path costs one comparison.
_UNCHECKED_BELOW = 1 << 26


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    out[key] = int(fields[0]) * 1024
    except OSError:
        pass
    return out


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError:
        return None
    return int(value) if value.isdigit() else None  # "max" (v2): no limit


def cgroup_memory_dirs() -> list[tuple[int, str]]:
    """(cgroup version, directory) of this process's memory cgroups (v2 and v1)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    dirs = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        path = path.rstrip("/")
        if controllers == "":
            dirs += [(2, f"/sys/fs/cgroup{path}"), (2, f"/sys/fs/cgroup/unified{path}")]
        elif "memory" in controllers.split(","):
            dirs.append((1, f"/sys/fs/cgroup/{controllers}{path}"))
    return [(version, d) for version, d in dirs if os.path.isdir(d)]


def _cgroup_limit(version: int, directory: str, swap: int) -> int | None:
    """Bytes of memory plus swap the cgroup at ``directory`` allows, or None: no limit."""
    if version == 2:
        memory = _read_int(os.path.join(directory, "memory.max"))
        if memory is None:
            return None
        swap_max = _read_int(os.path.join(directory, "memory.swap.max"))
        return memory + (swap if swap_max is None else min(swap, swap_max))
    memsw = _read_int(os.path.join(directory, "memory.memsw.limit_in_bytes"))
    if memsw is not None and memsw < _UNLIMITED:
        return memsw
    memory = _read_int(os.path.join(directory, "memory.limit_in_bytes"))
    return memory + swap if memory is not None and memory < _UNLIMITED else None


@functools.lru_cache(maxsize=1)
def _memory_bounds() -> tuple[tuple[int, str], ...]:
    """(bytes, what) for each bound on memory this process can have (Note [Requests beyond
    memory]); read once."""
    info = _meminfo()
    swap = info.get("SwapTotal", 0)
    bounds = []
    if "MemTotal" in info:
        bounds.append((info["MemTotal"] + swap, "this machine's memory (MemTotal + SwapTotal "
                                                 "in /proc/meminfo)"))
    for version, directory in cgroup_memory_dirs():
        root = "/sys/fs/cgroup"
        d = directory
        while d.startswith(root) and len(d) > len(root):  # ancestors limit it too
            limit = _cgroup_limit(version, d, swap)
            if limit is not None:
                bounds.append((limit, f"the memory limit of its cgroup ({d})"))
            d = os.path.dirname(d)
    return tuple(bounds)


def _size(nbytes: int) -> str:
    value, units = float(nbytes), ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    i = 0
    while value >= 1024 and i < len(units) - 1:
        value /= 1024
        i += 1
    return f"{nbytes} bytes" if i == 0 else f"{value:.1f} {units[i]}"


def check_request(nbytes: int, named: bool) -> None:
    """Raises if ``nbytes`` of shared memory can never be had (Note [Requests beyond memory]).

    Args:
        nbytes: bytes asked for.
        named: the ``file_system`` strategy (bounded by the size of ``/dev/shm`` too).

    Raises:
        SharedMemoryLimitError: ``nbytes`` exceeds the smallest bound; nothing was reserved.
    """
    if nbytes < _UNCHECKED_BELOW:
        return
    bounds = list(_memory_bounds())
    if named:
        try:
            st = os.statvfs("/dev/shm")
            bounds.append((st.f_blocks * st.f_frsize, "the size of /dev/shm"))
        except OSError:
            pass
    if not bounds:
        return
    limit, what = min(bounds)
    if nbytes <= limit:
        return
    fix = ("in Docker start the container with a larger --shm-size (or --ipc=host), or use the "
           "default file_descriptor strategy, which /dev/shm does not bound"
           if what == "the size of /dev/shm" else
           "raise the limit (docker --memory, the job's memory request)"
           if what.startswith("the memory limit") else "use a machine with more memory")
    raise SharedMemoryLimitError(
        errno.ENOMEM,
        f"cannot allocate {nbytes} bytes ({_size(nbytes)}) of shared memory: more than "
        f"{what} can ever hold ({limit} bytes, {_size(limit)}). Nothing was reserved. Ask "
        f"for less (split the data into smaller tensors), or {fix}",
        "shared memory")
