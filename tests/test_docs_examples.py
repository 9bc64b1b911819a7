"""Every Python code block of README.md and docs/*.md runs, as a script, in a fresh interpreter.

A fenced block whose info string starts with ``python`` (or ``py``) is one test: its text is
written to ``example.py`` in a temporary directory and run with ``python example.py`` there
(``PYTHONPATH`` pointing at this checkout), so blocks that start processes do it for real,
under the start method they name, with the ``if __name__ == "__main__":`` guard they show.
A block passes when the script exits 0 within its timeout.

A comment right before the fence (blank lines allowed) changes that:

- ``<!-- no-run: reason -->``: the block is not run; the test is skipped with the reason,
  so ``pytest -ra`` lists every block that does not run and why.
- ``<!-- setup: NAME -->``: the code ``SETUPS[NAME]`` (below; anything else after ``setup:``
  is taken as one line of code) runs before the block, for fragments that use what the
  surrounding prose says exists (a ``pool``, a ``model``, files to load).
- ``<!-- continues: previous -->``: the block continues the previous Python block of the
  same file, which runs first (with its own markers; chains are followed).
- ``<!-- timeout: 60 -->``: seconds, for a block that needs more than the default.
- ``<!-- slow: reason -->``: the block runs in the slow tier only (``--slow``; see
  tests/conftest.py): one that starts spawn workers or a forkserver, or runs for seconds.
  The fast tier runs the rest, a few blocks per page.

A block with ``setup`` or ``continues`` is assembled as a script the way one writes it for
spawn and forkserver: its imports, functions, classes and constants (``block_size = 1000``)
at module level, every other statement under ``if __name__ == "__main__":``, so workers that
import the main module get the functions and nothing else. A block without them runs exactly
as written.

The blocks run a few at a time (``DOC_EXAMPLE_JOBS``, default 3) in the background, started
by a module fixture; each test waits for its own block. Most of a block's time is spent
importing torch, so on 2 cores this more than halves the wall time.

Other languages (``bash``, ``text``) are not run.

Docstrings too: the fenced ``python`` block of an ``Example:`` (or ``Examples:``) section of a
docstring in ``torch_mp_ext/`` is a block like the others (found with ``ast``, importing
nothing; a string right after an assignment is that name's docstring, as griffe reads it).
Each runs as written, in the slow tier (each imports torch: a second or two apiece);
``tests/test_docs_site.py`` checks that every name of the API reference has one.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import child_pids, creator_pid

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DEFAULT_TIMEOUT_S = 120.0  # generous: 2 shared cores under load start spawn workers slowly
JOBS = int(os.environ.get("DOC_EXAMPLE_JOBS", 3))

# Code that fragments assume, named by their <!-- setup: NAME --> marker. The docs use none:
# an example a reader copies must run as shown (test_no_block_hides_its_setup).
SETUPS: dict[str, str] = {}

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(
    r"^<!--\s*(?P<kind>no-run|setup|continues|timeout|slow)\s*:\s*(?P<value>.*?)\s*-->$")


@dataclasses.dataclass
class Block:
    """One fenced code block: where it is, its language, its code and its markers."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    markers: dict[str, str]
    previous: Block | None = None  # the previous Python block of the same file

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with the markers just above each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    previous_python: Block | None = None
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        info = m.group("info").strip()
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            close = _FENCE.match(lines[j])
            closing = close and close.group("fence").startswith(fence)
            if closing and not close.group("info").strip():
                break
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        else:
            raise ValueError(f"{path}:{i + 1}: code block is never closed")
        block = Block(path, i + 1, info.split()[0] if info else "", "\n".join(body) + "\n",
                      _markers_above(lines, i), previous_python)
        if block.language in ("python", "py"):
            previous_python = block
        blocks.append(block)
        i = j + 1
    return blocks


def _markers_above(lines: list[str], fence_index: int) -> dict[str, str]:
    markers: dict[str, str] = {}
    k = fence_index - 1
    while k >= 0 and (not lines[k].strip() or _MARKER.match(lines[k].strip())):
        m = _MARKER.match(lines[k].strip())
        if m:
            markers.setdefault(m.group("kind"), m.group("value"))
        k -= 1
    return markers


def _sources(block: Block) -> list[str]:
    """The code to run for a block, earliest first: setups and continued blocks, then its own."""
    parts: list[str] = []
    if "continues" in block.markers:
        if block.previous is None:
            raise ValueError(f"{block.id}: `continues` but no earlier Python block")
        parts += _sources(block.previous)
    if "setup" in block.markers:
        name = block.markers["setup"]
        parts.append(textwrap.dedent(SETUPS.get(name, name)))
    parts.append(block.code)
    return parts


def script_for(block: Block) -> str:
    """The script a block runs as (see the module docstring)."""
    parts = _sources(block)
    if len(parts) == 1:
        return block.code
    top: list[str] = []
    main: list[str] = []
    for part in parts:
        lines = part.splitlines()
        for stmt in ast.parse(part).body:
            start = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])
            text = "\n".join(lines[start - 1:stmt.end_lineno])
            defines = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef,
                       ast.ClassDef)
            constant = isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)
            (top if isinstance(stmt, defines) or constant else main).append(text)
    body = textwrap.indent("\n".join(main) or "pass", "    ")
    return "\n".join(top) + '\n\nif __name__ == "__main__":\n' + body + "\n"


_EXAMPLE = re.compile(r"^(?P<indent> *)Examples?:\n(?P=indent) +```python\n(?P<code>.*?)\n *```$",
                      re.MULTILINE | re.DOTALL)


def docstring_examples(path: Path) -> list[Block]:
    """The ``Example:`` blocks of the docstrings of one module (see the module docstring)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs: list[tuple[int, str]] = []

    def string_at(stmt: ast.stmt) -> None:
        if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)):
            docs.append((stmt.lineno, stmt.value.value))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            string_at(node.body[0])
            for before, after in zip(node.body, node.body[1:]):  # attribute docstrings
                if isinstance(before, (ast.Assign, ast.AnnAssign)):
                    string_at(after)
    blocks = []
    for line, doc in sorted(set(docs)):
        for m in _EXAMPLE.finditer(doc):
            code = textwrap.dedent(m.group("code")) + "\n"
            first = line + doc[:m.start("code")].count("\n")
            blocks.append(Block(path, first, "python", code,
                                {"slow": "a docstring example: each imports torch"}))
    return blocks


def python_blocks() -> list[Block]:
    docs = [b for p in DOC_FILES for b in parse_blocks(p) if b.language in ("python", "py")]
    package = sorted((ROOT / "torch_mp_ext").rglob("*.py"))
    return docs + [b for p in package for b in docstring_examples(p)]


BLOCKS = python_blocks()


def run_block(block: Block) -> tuple[str, str]:
    """Runs a block's script; ("ok" | "failed" | "timeout", details)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    timeout = float(block.markers.get("timeout", DEFAULT_TIMEOUT_S))
    with tempfile.TemporaryDirectory(prefix="tmx_doc_example_") as tmp:
        script = Path(tmp) / "example.py"
        script.write_text(script_for(block), encoding="utf-8")
        try:
            proc = subprocess.run([sys.executable, script.name], cwd=tmp, env=env,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as e:
            return "timeout", f"still running after {timeout:g} s\n{e.stdout!r}\n{e.stderr!r}"
    if proc.returncode != 0:
        return "failed", (f"exited with {proc.returncode}\n--- script\n{script_for(block)}"
                          f"\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return "ok", ""


def _shm_of_dead_processes() -> set[str]:
    """torch_mp_ext/torch segments in /dev/shm whose creator (torch_<pid>_...) is dead."""
    out = set()
    for name in os.listdir("/dev/shm"):
        if not name.startswith(("torch_", "tmx_")):
            continue
        pid = creator_pid(name)
        try:
            if pid is None:
                raise ProcessLookupError
            os.kill(pid, 0)
        except ProcessLookupError:
            out.add(name)
        except PermissionError:
            pass
    return out


@dataclasses.dataclass
class Runs:
    """The blocks running in the background, and what /dev/shm held before they started."""

    futures: dict[str, concurrent.futures.Future]
    shm_before: set[str]


@pytest.fixture(scope="module")
def runs(request):
    """Starts the selected blocks, JOBS at a time, in the background; each test waits for its
    own. Their processes run while other example tests finish, so those tests skip the
    per-test leak check; ``test_examples_left_nothing_behind`` checks after the last one."""
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "callspec", None) and "block" in item.callspec.params]
    runnable = [b for b in selected if "no-run" not in b.markers]
    shm_before = _shm_of_dead_processes()
    with concurrent.futures.ThreadPoolExecutor(max_workers=JOBS) as pool:
        yield Runs({b.id: pool.submit(run_block, b) for b in runnable}, shm_before)


def test_every_doc_file_is_collected():
    """The collector sees the blocks that are there (guards against a parser that finds none)."""
    assert len(DOC_FILES) >= 10
    assert len(BLOCKS) >= 20
    for b in BLOCKS:
        for reasoned in ("no-run", "slow"):
            if reasoned in b.markers:
                assert b.markers[reasoned], f"{b.id}: a {reasoned} marker needs its reason"
        if "setup" in b.markers and b.markers["setup"] not in SETUPS:
            compile(b.markers["setup"], b.id, "exec")


def test_no_block_hides_its_setup():
    """What a block needs is in it, or in the earlier block it visibly continues: a
    ``setup`` marker is an HTML comment, which the rendered page does not show."""
    hidden = [b.id for b in BLOCKS if "setup" in b.markers]
    assert not hidden, f"blocks whose setup the reader cannot see: {hidden}"


def test_parser_reads_markers(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "text\n\n<!-- no-run: needs a GPU -->\n```python\nimport cuda\n```\n\n"
        "<!-- setup: x = 1 -->\n<!-- timeout: 5 -->\n\n```python\nprint(x)\n```\n"
        "~~~text\n```python\n~~~\n   ```py title\n   a = 1\n   ```\n",
        encoding="utf-8",
    )
    blocks = parse_blocks(doc)
    assert [(b.line, b.language) for b in blocks] == [(4, "python"), (11, "python"),
                                                      (14, "text"), (17, "py")]
    assert blocks[0].markers == {"no-run": "needs a GPU"}
    assert blocks[1].markers == {"setup": "x = 1", "timeout": "5"}
    assert blocks[1].code == "print(x)\n"
    assert blocks[2].code == "```python\n"
    assert blocks[3].code == "a = 1\n"
    assert blocks[3].previous is blocks[1]


def test_continued_blocks_keep_functions_at_module_level(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "```python\nimport os\n\n@staticmethod\ndef f():\n    pass\nx = f\n```\n\n"
        "<!-- continues: previous -->\n```python\nclass C:\n    pass\nprint(x, C)\n```\n",
        encoding="utf-8",
    )
    script = script_for(parse_blocks(doc)[1])
    assert script == ('import os\n@staticmethod\ndef f():\n    pass\nclass C:\n    pass\n\n'
                      'if __name__ == "__main__":\n    x = f\n    print(x, C)\n')


@pytest.mark.no_leak_check  # other blocks' processes are running meanwhile: see `runs`
@pytest.mark.parametrize("block", [
    pytest.param(b, id=b.id, marks=[pytest.mark.slow] if "slow" in b.markers else [])
    for b in BLOCKS])
def test_doc_example_runs(block: Block, runs: Runs):
    if "no-run" in block.markers:
        pytest.skip(f"marked no-run: {block.markers['no-run']}")
    status, details = runs.futures[block.id].result()
    assert status == "ok", f"{block.id}: {details}"


@pytest.mark.every_tier  # checks after the tier's blocks, whichever tier runs
def test_examples_left_nothing_behind(runs: Runs):
    """After every block ended: no segment of a dead process in /dev/shm, no child left."""
    concurrent.futures.wait(runs.futures.values())
    deadline = time.monotonic() + 15
    while True:
        leaked = sorted(_shm_of_dead_processes() - runs.shm_before)
        kids = child_pids()
        if not (leaked or kids) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not leaked, f"the examples left shared memory behind in /dev/shm: {leaked}"
    assert not kids, f"the examples left processes behind: {kids}"
