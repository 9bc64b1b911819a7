"""Docs a newcomer can trust: every quoted figure is the run of its plot, no internal jargon.

- The tables of ``docs/results.md`` are what ``tools/results_page.py`` renders from
  ``docs/results/*.json``, and every figure README.md and ``docs/index.md`` quote (a ratio, a
  time, a size in MiB) is one that JSON gives (Note [One run per claim] in that tool).
- Each plot in ``docs/img/`` was drawn from the JSON of the same name as it is now
  (``tools/plot_benchmarks.py`` stamps the file's SHA-256 into the PNG).
- User pages (README.md and ``docs/``, less the contributor pages) name no seed document, no
  issue number, no commit hash, no machine path and no source-code Note.

All of it reads files only: well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import struct
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: Pages for contributors (the nav's last section): history and internals belong there.
CONTRIBUTOR_PAGES = {DOCS / "architecture.md", DOCS / "benchmarks.md"}
USER_PAGES = [ROOT / "README.md",
              *(p for p in sorted(DOCS.rglob("*.md")) if p not in CONTRIBUTOR_PAGES)]
FIGURE_PAGES = [ROOT / "README.md", DOCS / "index.md"]


def _tool():
    spec = importlib.util.spec_from_file_location("results_page",
                                                  ROOT / "tools" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


results_page = _tool()
RESULTS = results_page.load_results()
FIGURES = results_page.figures(RESULTS)


def test_results_page_tables_are_rendered_from_the_json():
    text = results_page.PAGE.read_text(encoding="utf-8")
    assert text == results_page.render_page(text, RESULTS), (
        "docs/results.md: a table differs from docs/results/*.json; "
        "run python tools/results_page.py")
    shown = set(re.findall(r"<!-- results-table: ([\w-]+) -->", text))
    assert set(RESULTS) | {"machine", "runs"} == shown, "a result without a table, or back"


def test_readme_and_front_page_figures_are_those_of_the_json():
    for page in FIGURE_PAGES:
        text = page.read_text(encoding="utf-8")
        quoted = results_page.FIGURE_SHAPE.findall(text)
        assert len(quoted) >= 8, f"{page.name}: expected the headline figures, found {quoted}"
        wrong = results_page.unbacked_figures(text, FIGURES.values())
        assert not wrong, (
            f"{page.relative_to(ROOT)} quotes {wrong}, which no run in docs/results/ gives: "
            "quote the figures of `python tools/results_page.py --figures`")


def test_a_figure_from_another_run_is_caught():
    text = "Arena-born hand-offs take 53-72 us, 6-11x faster, and 49-60 us; 9.4x; 77.7x."
    assert results_page.unbacked_figures(text, FIGURES.values()) == ["53-72 us", "6-11x"]
    assert FIGURES["handoff.arena_born"] == "49-60 us"  # the plotted run's, as quoted


def _png_text(path: Path) -> dict[str, str]:
    """The tEXt chunks of a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    out, i = {}, 8
    while i < len(data):
        (length,) = struct.unpack(">I", data[i:i + 4])
        kind, body = data[i + 4:i + 8], data[i + 8:i + 8 + length]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            out[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        i += 12 + length
    return out


def test_each_plot_is_drawn_from_its_json():
    for name in RESULTS:
        png = DOCS / "img" / f"{name}.png"
        digest = hashlib.sha256((DOCS / "results" / f"{name}.json").read_bytes()).hexdigest()
        source = _png_text(png).get("Source", "")
        assert digest in source, (
            f"docs/img/{name}.png was not drawn from docs/results/{name}.json as it is now: "
            "python tools/plot_benchmarks.py docs/results/*.json --out docs/img")


#: What a reader of the site cannot follow: (what, pattern).
JARGON = [
    ("the word 'seed'", re.compile(r"(?<!random )\bseeds?\b", re.IGNORECASE)),
    ("an issue number", re.compile(r"\bissues? #?\d+", re.IGNORECASE)),
    ("a commit hash", re.compile(r"(?<![-\w])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")),
    ("a machine path", re.compile(r"(?:/work/|/home/|/root/|/Users/|/tmp/(?!pytorch-errorfile))")),
    ("a source-code Note", re.compile(r"\bNote \[")),
]


def jargon(text: str) -> list[str]:
    """``line: what: 'match'`` for each piece of internal vocabulary in ``text``."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in JARGON:
            out += [f"{number}: {what}: {m.group(0)!r}" for m in pattern.finditer(line)]
    return out


def test_user_pages_have_no_internal_vocabulary():
    found = [f"{page.relative_to(ROOT)}:{hit}" for page in USER_PAGES
             for hit in jargon(page.read_text(encoding="utf-8"))]
    assert not found, ("internal vocabulary on user pages (move it to the benchmark log or "
                       "docs/architecture.md):\n" + "\n".join(found))


def _api_docstrings():
    """(entry or member path, docstring as the site shows it) for the API reference."""
    griffe = pytest.importorskip("griffe", reason="pip install -e '.[docs]' (or '.[test]')")
    roles = importlib.util.spec_from_file_location("griffe_roles",
                                                   ROOT / "tools" / "griffe_roles.py")
    module = importlib.util.module_from_spec(roles)
    roles.loader.exec_module(module)
    package = griffe.load("torch_mp_ext", search_paths=[str(ROOT)])
    pages = "\n".join(p.read_text(encoding="utf-8") for p in sorted((DOCS / "api").glob("*.md")))
    for path in re.findall(r"^:::\s+([\w.]+)\s*$", pages, re.MULTILINE):
        obj = package[path.split(".", 1)[1]]
        target = obj.final_target if obj.is_alias else obj
        members = target.members.items() if target.is_class else ()
        for name, member in [("", target), *members]:
            if name.startswith("_") or member.is_alias:
                continue
            if member.docstring is not None:
                yield f"{path}.{name}".rstrip("."), module.for_readers(member.docstring.value)


def test_api_reference_has_no_internal_vocabulary():
    """The docstrings keep their pointers to source Notes for contributors; the site's
    extension (tools/griffe_roles.py) leaves them out, and no docstring says 'seed'."""
    found = [f"{path}: {hit}" for path, doc in _api_docstrings() for hit in jargon(doc)]
    assert not found, "internal vocabulary on the API pages:\n" + "\n".join(found)


def test_the_jargon_check_finds_each_kind():
    text = ("as in the seed, fixed in issue 15 (c571731); a random seed is fine\n"
            "see Note [Pooled names]; made with --json /work/tmp/x.json\n"
            "torch leaves /tmp/pytorch-errorfile-*.pickle; fd server @tmx-12285-f161f9ca23f4\n")
    assert [hit.split(": ", 1)[1] for hit in jargon(text)] == [
        "the word 'seed': 'seed'", "an issue number: 'issue 15'",
        "a commit hash: 'c571731'", "a machine path: '/work/'",
        "a source-code Note: 'Note ['"]
