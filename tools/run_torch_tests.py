"""Runs PyTorch's own multiprocessing tests against torch_mp_ext.

Usage::

    python tools/run_torch_tests.py PATH [PATH ...] [-- unittest args]

Each PATH is a test file (e.g. a checkout's ``test/test_multiprocessing_spawn.py``) or a
directory holding ``test_multiprocessing.py`` and ``test_multiprocessing_spawn.py``. Each file
is copied to a temporary directory with ``import torch.multiprocessing as mp`` replaced by
``import torch_mp_ext as mp``, run as ``python FILE -v`` with this checkout first on
``PYTHONPATH``, and removed. Nothing from PyTorch is kept in this repository. The exit status
is non-zero if any file failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORIGINAL = "import torch.multiprocessing as mp"
REPLACEMENT = "import torch_mp_ext as mp"
DEFAULT_FILES = ("test_multiprocessing.py", "test_multiprocessing_spawn.py")


def _files(paths: list[str]) -> list[str]:
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += [os.path.join(path, name) for name in DEFAULT_FILES
                      if os.path.exists(os.path.join(path, name))]
        else:
            files.append(path)
    return files


def run(path: str, extra_args: list[str]) -> int:
    """Runs one rewritten test file; returns its exit status."""
    with open(path) as f:
        source = f.read()
    if ORIGINAL not in source:
        print(f"{path}: no '{ORIGINAL}' line to replace", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="tmx-torch-tests-")
    try:
        copy = os.path.join(workdir, os.path.basename(path))
        with open(copy, "w") as f:
            f.write(source.replace(ORIGINAL, REPLACEMENT))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
        print(f"== {path} (torch.multiprocessing -> torch_mp_ext)", flush=True)
        return subprocess.call([sys.executable, copy, "-v", *extra_args], cwd=REPO, env=env)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str]) -> int:
    if "--" in argv:
        split = argv.index("--")
        paths, extra = argv[:split], argv[split + 1:]
    else:
        paths, extra = argv, []
    files = _files(paths)
    if not files:
        print(__doc__, file=sys.stderr)
        return 2
    statuses = [run(path, extra) for path in files]
    return max(statuses)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
