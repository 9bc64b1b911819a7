"""The platform floor (Note [Platform floor] in csrc/platform/compat.h): no glibc symbol newer
than 2.28 in the extension, and the fallbacks for newer calls, forced on with
TORCH_MP_EXT_FALLBACKS=1, doing the same work as the calls they stand in for."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import torch_mp_ext as mp

GLIBC_FLOOR = (2, 28)  # torch's own wheels: manylinux_2_28
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="the floor is pinned for x86_64 builds, and read with objdump")
def test_the_extension_needs_no_glibc_newer_than_the_floor():
    out = subprocess.run(["objdump", "-T", mp._C.__file__], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    versions = {}
    for line in out.splitlines():
        match = re.search(r"\(?GLIBC_(\d+)\.(\d+)(?:\.\d+)?\)?\s+(\S+)$", line)
        if match:
            versions[match.group(3)] = (int(match.group(1)), int(match.group(2)))
    assert versions, "objdump -T listed no glibc symbol: the parse is wrong"
    newer = {name: v for name, v in versions.items() if v > GLIBC_FLOOR}
    assert not newer, f"symbols newer than glibc {GLIBC_FLOOR}: {newer}"


def _run(script: str, env: dict, unshare_dev_shm: str | None = None):
    cmd = [sys.executable, "-c", textwrap.dedent(script)]
    if unshare_dev_shm:
        shell = f"mount -t tmpfs -o size={unshare_dev_shm} tmpfs /dev/shm && exec \"$@\""
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell, "sh", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO, **env))


def test_the_switch_forces_every_fallback_and_only_when_set():
    script = "import torch_mp_ext as mp; print(sorted(mp._C.platform_features().items()))"
    forced = _run(script, {"TORCH_MP_EXT_FALLBACKS": "1"})
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.strip() == str(sorted({"fallbacks_forced": True, "clocklock": False,
                                                "seals": False, "pidfd": False}.items()))
    # And only when set: this process was started with or without it.
    assert mp._C.platform_features()["fallbacks_forced"] is (
        os.environ.get("TORCH_MP_EXT_FALLBACKS") == "1")


GROW = """
    import torch_mp_ext as mp
    from torch_mp_ext.errors import SharedMemoryError
    mp._C.set_anonymous_backend("shm")  # rings in /dev/shm files, which the tmpfs limits
    q = mp.Queue()  # a 64 KiB ring at first (TORCH_MP_EXT_QUEUE_BYTES): it has to grow
    item = bytes(range(250)) * 8
    n = 0
    try:
        for n in range(20000):  # 40 MB of frames into a 24 MB /dev/shm
            q.put_nowait(item)
    except SharedMemoryError as e:
        print("full", e.errno, "(a queue growing to" in str(e), "--shm-size" in str(e))
    got = 0
    while not q.empty():
        assert q.get(timeout=30) == item
        got += 1
    print(n, got, mp._C.platform_features()["fallbacks_forced"])
"""


@pytest.mark.slow  # two 24 MB rings filled in private mount namespaces: 4 s
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) to mount a small tmpfs on /dev/shm")
@pytest.mark.parametrize("forced", ["0", "1"], ids=["madvise", "fallback"])
def test_a_ring_that_cannot_grow_on_a_full_dev_shm_raises_and_keeps_its_items(forced):
    """Without MADV_POPULATE_WRITE (Linux < 5.14, or forced), the ring's new pages are written
    from /dev/zero: a full tmpfs fails that read with EFAULT, never with a SIGBUS."""
    done = _run(GROW, {"TORCH_MP_EXT_FALLBACKS": forced, "TORCH_MP_EXT_QUEUE_BYTES": "65536"},
                unshare_dev_shm="24m")
    assert done.returncode == 0, done.stderr[-3000:]
    full, counts = done.stdout.splitlines()
    assert full == "full 28 True True"  # ENOSPC, naming the queue and the fix
    put, got, was_forced = counts.split()
    assert int(put) == int(got) > 1000 and was_forced == str(forced == "1")
