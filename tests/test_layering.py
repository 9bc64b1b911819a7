"""The package layout keeps the layers of docs/architecture.md.

Reads every module of ``torch_mp_ext`` (no import needed) and checks, for imports at any
depth (module level and inside functions alike, so a cycle cannot hide in a lazy import):

- a module imports only from its own subpackage or from a lower layer;
- no module imports another module's private name (``_x``), nor reads one as an attribute of
  a module it imported; ``_C``, the extension, is the one private module everybody uses;
- the module import graph has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "torch_mp_ext"

# docs/architecture.md, "Which may import which": lower layers first.
LAYERS = [
    {"_C", "_version", "errors", "timeouts"},
    {"torch_internals"},
    {"sharing", "cuda"},
    {"reductions", "data"},
    {"queues"},
    {"processes"},
    {"exchange", "pipeline", "tasks"},
    {"spawn"},
    {"__init__"},
    {"cli"},
    {"__main__"},
]
# Private modules every layer may use: the extension and the version string.
SHARED_PRIVATE = {"_C", "_version"}
# Names torch.multiprocessing itself exports though private: the drop-in surface re-exports.
DROP_IN_PRIVATE = {("__init__", "_all_sharing_strategies")}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _unit(module: str) -> str:
    """The layer unit a module belongs to: its top-level subpackage or module."""
    return module.split(".")[0]


def _layer(module: str) -> int:
    unit = _unit(module)
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"{module} is in no layer of docs/architecture.md: add it there and here")


def _package_of(module: str, path: Path) -> list[str]:
    parts = module.split(".")
    return parts if path.name == "__init__.py" and module != "__init__" else parts[:-1]


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str | None:
    """The torch_mp_ext module an ImportFrom reads from, or None if outside the package."""
    if node.level == 0:
        name = node.module or ""
        if name != "torch_mp_ext" and not name.startswith("torch_mp_ext."):
            return None
        return name[len("torch_mp_ext."):] if "." in name else "__init__"
    base = _package_of(module, path)
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    full = ".".join([*base, *(node.module.split(".") if node.module else [])])
    return full or "__init__"


def _imports(module: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for each intra-package import."""
    out: list[tuple[str, str | None, int]] = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            if target is None:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target != "__init__" else alias.name
                if sub in MODULES or alias.name == "_C":
                    out.append((sub, None, node.lineno))
                else:
                    out.append((target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch_mp_ext."):
                    out.append((alias.name[len("torch_mp_ext."):], None, node.lineno))
    return out


def _private_attribute_reads(module: str, path: Path) -> list[str]:
    """``mod._name`` where ``mod`` was imported from this package (other than ``_C``)."""
    tree = ast.parse(path.read_text(), str(path))
    module_aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _resolve(module, path, node) is not None:
            target = _resolve(module, path, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target != "__init__" else alias.name
                if sub in MODULES:
                    module_aliases.add(alias.asname or alias.name)
    bad = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            bad.append(f"{module}:{node.lineno} reads {node.value.id}.{node.attr}")
    return bad


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in SHARED_PRIVATE


def test_imports_follow_the_layers() -> None:
    bad = []
    for module, path in MODULES.items():
        mine = _layer(module)
        for target, _name, line in _imports(module, path):
            if target == "_C" or _unit(target) == _unit(module):
                continue
            if _layer(target) >= mine:
                bad.append(f"{module}:{line} imports {target} "
                           f"(layer {_layer(target)} >= {mine})")
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_modules() -> None:
    bad = []
    for module, path in MODULES.items():
        for target, name, line in _imports(module, path):
            if target != module and any(_is_private(p) for p in target.split(".")):
                bad.append(f"{module}:{line} imports private module {target}")
            if (name is not None and _is_private(name)
                    and (module, name) not in DROP_IN_PRIVATE):
                bad.append(f"{module}:{line} imports private name {target}.{name}")
        bad += _private_attribute_reads(module, path)
    assert not bad, "\n".join(bad)


def test_no_import_cycle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, _name, _line in _imports(module, path):
            if target in MODULES and target != module:
                graph[module].add(target)
    # A package's __init__ importing its own submodules is how packages work, and a
    # submodule's "from . import sibling" goes through it: count edges between submodules.
    for module in graph:
        graph[module] = {t for t in graph[module]
                         if not (module.startswith(t + ".") and t != "__init__")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_every_subpackage_states_its_public_names() -> None:
    for module, path in MODULES.items():
        if path.name == "__init__.py" and module != "__init__":
            tree = ast.parse(path.read_text())
            names = {t.id for n in tree.body if isinstance(n, ast.Assign)
                     for t in n.targets if isinstance(t, ast.Name)}
            assert "__all__" in names, f"{module}/__init__.py has no __all__"
