"""The documentation site builds with ``mkdocs build --strict`` and documents every public name.

The site (``mkdocs.yml``, ``docs/``) is MkDocs with mkdocstrings' Python handler, which reads
the docstrings statically with griffe: the build imports nothing. ``--strict`` turns every
warning into a failure: a broken link or anchor, a page left out of the nav, a reference
(``::: path``) that does not resolve, a docstring griffe cannot parse.

Coverage: every name in each subpackage's ``__all__`` (and in ``errors.__all__``), and every
public top-level name beyond the standard library's ``multiprocessing.__all__``, has a
``::: path`` entry in ``docs/api/`` that is that very object, and the entry has a docstring
(as griffe reads it, i.e. as the site shows it).
"""

from __future__ import annotations

import importlib
import multiprocessing
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import torch_mp_ext

ROOT = Path(__file__).resolve().parents[1]
API_DIR = ROOT / "docs" / "api"
SUBPACKAGES = ["sharing", "cuda", "queues", "processes", "pipeline", "tasks", "exchange",
               "data"]
MODULES_WITH_ALL = [*SUBPACKAGES, "errors"]
# Top-level names that are not ours to document: torch's private helpers it exports.
TOP_LEVEL_NOT_OURS = {"annotations"}

griffe = pytest.importorskip("griffe", reason="pip install -e '.[docs]' (or '.[test]')")
pytest.importorskip("mkdocs", reason="pip install -e '.[docs]' (or '.[test]')")
pytest.importorskip("mkdocstrings_handlers.python", reason="pip install -e '.[docs]'")

_DIRECTIVE = re.compile(r"^:::\s+(?P<path>[\w.]+)\s*$", re.MULTILINE)


def reference_entries() -> dict[str, Path]:
    """``::: path`` directives of the API pages, path -> page."""
    entries: dict[str, Path] = {}
    for page in sorted(API_DIR.glob("*.md")):
        for m in _DIRECTIVE.finditer(page.read_text(encoding="utf-8")):
            entries[m.group("path")] = page
    return entries


def resolve(path: str) -> object:
    """The runtime object a dotted path names: the longest importable module, then attributes
    (so ``torch_mp_ext.processes.spawn.spawn`` is the function in the module ``spawn``)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj: object = importlib.import_module(name)
        except ImportError:
            continue
        if i < len(parts) and not isinstance(sys.modules.get(name), types.ModuleType):
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise LookupError(path)


def public_names() -> list[tuple[str, str, object]]:
    """(where, name, object) for every name the reference must cover."""
    out = []
    for mod_name in MODULES_WITH_ALL:
        mod = importlib.import_module(f"torch_mp_ext.{mod_name}")
        out += [(f"torch_mp_ext.{mod_name}", n, getattr(mod, n)) for n in mod.__all__]
    stdlib = set(multiprocessing.__all__)
    for name in sorted(vars(torch_mp_ext)):
        obj = getattr(torch_mp_ext, name)
        if (name.startswith("_") or name in stdlib or name in TOP_LEVEL_NOT_OURS
                or isinstance(obj, types.ModuleType)):
            continue
        out.append(("torch_mp_ext", name, obj))
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, (str, int, float)) and isinstance(b, type(a)):
        return a == b
    return a is b


def test_every_public_name_has_a_reference_entry():
    entries = {path: resolve(path) for path in reference_entries()}
    missing = []
    for where, name, obj in public_names():
        if not any(path.rsplit(".", 1)[-1] == name and _same(target, obj)
                   for path, target in entries.items()):
            missing.append(f"{where}.{name}")
    assert not missing, (
        "public names without a `::: path` entry in docs/api/*.md: " + ", ".join(missing))


def test_every_reference_entry_has_a_docstring():
    package = griffe.load("torch_mp_ext", search_paths=[str(ROOT)])
    undocumented = []
    for path in reference_entries():
        obj = package[path.split(".", 1)[1]]
        target = obj.final_target if obj.is_alias else obj
        if target.docstring is None or not target.docstring.value.strip():
            undocumented.append(path)
    assert not undocumented, "entries whose object has no docstring: " + ", ".join(undocumented)


_EXAMPLE = re.compile(r"^ *Examples?:\n +```python\n", re.MULTILINE)

#: Reference entries whose docstring has no ``Example:`` yet (none: keep it so). An entry
#: listed here that gains an example must leave the list (the test says which).
NO_EXAMPLE_YET: frozenset = frozenset()

#: Reference entries with parameters but no ``Args:`` table yet; shrinks like the one above.
#: Each is made by torch_mp_ext and handed to users (refs, pipelines, errors, the
#: ``rebuild_*`` functions that unpickling calls), not called by them.
NO_ARGS_YET = frozenset({
    "torch_mp_ext.errors.DataLoaderWorkerError",
    "torch_mp_ext.errors.PipelineError",
    "torch_mp_ext.errors.ProcessFailure",
    "torch_mp_ext.errors.RemoteTaskError",
    "torch_mp_ext.errors.ReturnCountError",
    "torch_mp_ext.errors.WorkerDiedError",
    "torch_mp_ext.exchange.Context",
    "torch_mp_ext.pipeline.Pipeline",
    "torch_mp_ext.pipeline.Stage",
    "torch_mp_ext.processes.SpawnContext",
    "torch_mp_ext.reductions.rebuild_array",
    "torch_mp_ext.reductions.rebuild_cpu_tensor",
    "torch_mp_ext.reductions.rebuild_cuda_tensor",
    "torch_mp_ext.reductions.rebuild_storage",
    "torch_mp_ext.reductions.rebuild_tensor",
    "torch_mp_ext.tasks.Ref",
    "torch_mp_ext.tasks.RefGenerator",
})


def _entries_where(check) -> set[str]:
    package = griffe.load("torch_mp_ext", search_paths=[str(ROOT)])
    out = set()
    for path in reference_entries():
        obj = package[path.split(".", 1)[1]]
        target = obj.final_target if obj.is_alias else obj
        if check(target):
            out.add(path)
    return out


def _ratchet(missing: set[str], allowed: frozenset, what: str) -> None:
    new = sorted(missing - allowed)
    assert not new, f"entries without {what} (add one to the docstring): " + ", ".join(new)
    done = sorted(allowed - missing)
    assert not done, f"these have {what} now: remove them from the test's list: " + ", ".join(
        done)


def test_every_reference_entry_has_an_example():
    """Each example is then run by tests/test_docs_examples.py (slow tier)."""
    missing = _entries_where(lambda t: not (t.docstring and _EXAMPLE.search(t.docstring.value)))
    _ratchet(missing, NO_EXAMPLE_YET, "an `Example:` section with a ```python block")


def _parameters(target) -> list[str]:
    if target.is_class:
        init = target.members.get("__init__")
        params = init.parameters if init is not None and init.is_function else []
    elif target.is_function:
        params = target.parameters
    else:
        return []
    return [p.name for p in params if p.name not in ("self", "cls")]


def test_every_reference_entry_with_parameters_has_a_parameter_table():
    missing = _entries_where(lambda t: _parameters(t) and not (
        t.docstring and re.search(r"^ *(Args|Arguments|Parameters):$", t.docstring.value,
                                  re.MULTILINE)))
    _ratchet(missing, NO_ARGS_YET, "an `Args:` section (the site's parameter table)")


def test_drop_in_table_covers_the_stdlib_names():
    """docs/api/index.md says what each of multiprocessing.__all__ is under torch_mp_ext."""
    text = (API_DIR / "index.md").read_text(encoding="utf-8")
    table = text.split("## The drop-in surface", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(\w+)`", table))
    assert set(multiprocessing.__all__) <= named, set(multiprocessing.__all__) - named


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "api" / "queues" / "index.html").exists()
    html = (tmp_path / "api" / "sharing" / "index.html").read_text(encoding="utf-8")
    assert "torch_mp_ext.sharing.empty" in html  # entries render with their anchors
