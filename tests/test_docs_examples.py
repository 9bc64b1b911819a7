"""Every Python code block of README.md and docs/*.md runs, as a script, in a fresh interpreter.

A fenced block whose info string starts with ``python`` (or ``py``) is one test: its text is
written to ``example.py`` in a temporary directory and run with ``python example.py`` there
(``PYTHONPATH`` pointing at this checkout), so blocks that start processes do it for real,
under the start method they name, with the ``if __name__ == "__main__":`` guard they show.
A block passes when the script exits 0 within its timeout.

A comment right before the fence (blank lines allowed) changes that:

- ``<!-- no-run: reason -->``: the block is not run; the test is skipped with the reason,
  so ``pytest -ra`` lists every block that does not run and why.
- ``<!-- setup: code -->``: ``code`` (one line; ``;`` separates statements) runs before
  the block, for fragments that continue an earlier example (e.g. ``pool = ...``). Keep it to
  what the surrounding prose already says exists.
- ``<!-- timeout: 60 -->``: seconds, for a block that needs more than the default.

Other languages (``bash``, ``text``) are not run.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEFAULT_TIMEOUT_S = 45.0

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(r"^<!--\s*(?P<kind>no-run|setup|timeout)\s*:\s*(?P<value>.*?)\s*-->$")


@dataclasses.dataclass
class Block:
    """One fenced code block: where it is, its language, its code and its markers."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    markers: dict[str, str]

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with the markers just above each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
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
            if close and close.group("fence").startswith(fence) and not close.group("info").strip():
                break
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        else:
            raise ValueError(f"{path}:{i + 1}: code block is never closed")
        blocks.append(Block(path, i + 1, info.split()[0] if info else "", "\n".join(body) + "\n",
                            _markers_above(lines, i)))
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


def python_blocks() -> list[Block]:
    return [b for p in DOC_FILES for b in parse_blocks(p) if b.language in ("python", "py")]


BLOCKS = python_blocks()


def test_every_doc_file_is_collected():
    """The collector sees the blocks that are there (guards against a parser that finds none)."""
    assert len(DOC_FILES) >= 10
    assert len(BLOCKS) >= 20
    for b in BLOCKS:
        if "no-run" in b.markers:
            assert b.markers["no-run"], f"{b.id}: a no-run marker needs its reason"


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


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_example_runs(block: Block, tmp_path):
    if "no-run" in block.markers:
        pytest.skip(f"marked no-run: {block.markers['no-run']}")
    setup = block.markers.get("setup", "")
    script = tmp_path / "example.py"
    script.write_text(f"{setup}\n{block.code}" if setup else block.code, encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    timeout = float(block.markers.get("timeout", DEFAULT_TIMEOUT_S))
    try:
        proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.id}: still running after {timeout:g} s\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, (
        f"{block.id} exited with {proc.returncode}\n--- stdout\n{proc.stdout}"
        f"\n--- stderr\n{proc.stderr}"
    )
