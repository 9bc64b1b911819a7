"""torch's private names are used through torch_internals.py only, and a torch without one
fails loudly at import (Note [Torch internals] in torch_mp_ext/torch_internals.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torch

from torch_mp_ext import torch_internals

PACKAGE = Path(torch_internals.__file__).resolve().parent


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(
        p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:])


def _dotted(node: ast.AST) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(names)])
    return None


def _private_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if _private(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None),
                                                                 ast.Attribute):
            dotted = _dotted(node)
            if dotted and _private(dotted):
                found.append(f"{dotted} (line {node.lineno})")
    return found


def test_no_module_but_torch_internals_names_a_private_torch_name():
    uses = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "torch_internals.py":
            found = _private_uses(path)
            if found:
                uses[str(path.relative_to(PACKAGE))] = sorted(set(found))
    assert not uses, uses
    # The scan itself finds what it should: torch_internals.py names several.
    assert len(_private_uses(PACKAGE / "torch_internals.py")) >= 1


def test_this_torch_is_one_we_claim_and_imports_without_a_warning():
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert release in torch_internals.TESTED_TORCH
    out = subprocess.run(
        [sys.executable, "-W", "error::torch_mp_ext.errors.UntestedTorchWarning", "-c",
         "import torch_mp_ext"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_torch_without_a_needed_name_fails_at_import_naming_it():
    # A real torch with one private function removed, as a release that renamed it would be.
    code = ("import torch._utils\n"
            "del torch._utils._rebuild_tensor\n"
            "import torch_mp_ext\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("torch_mp_ext.errors.TorchVersionError: "), out.stderr
    assert f"torch {torch.__version__} has no torch._utils._rebuild_tensor" in last
    assert "tested with torch 2.13, 2.14" in last
