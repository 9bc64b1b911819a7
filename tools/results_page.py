"""The results page's tables and the front page's figures, computed from ``docs/results/*.json``.

    python tools/results_page.py            # rewrites the tables of docs/results.md
    python tools/results_page.py --check    # exits 1, naming the table, if one is stale
    python tools/results_page.py --figures  # prints every figure README.md may quote

Each benchmark's JSON (``--json PATH`` of ``benchmarks/bench_*.py``) is the one source of its
table on ``docs/results.md``, of its plot in ``docs/img/`` (``tools/plot_benchmarks.py``) and of
every figure README.md and ``docs/index.md`` quote. A table sits on the page between
``<!-- results-table: NAME -->`` and ``<!-- /results-table -->``; everything between is
rewritten. ``tests/test_docs_results.py`` fails when a table, a README figure or a front-page
figure differs from what the JSON gives.

Note [One run per claim]: a figure is quoted only as this module formats it (ratios to one
decimal with ``x``, times in whole microseconds, memory in MiB), so the test can find every
figure in a page by its shape and look it up among :func:`figures`. A number written by hand
in that shape is flagged unless some result gives exactly it; rerunning a benchmark and
writing its JSON then makes the test name every page that quotes the old run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "results.md"

Doc = Dict[str, Any]
_BLOCK = re.compile(r"(<!-- results-table: (?P<name>[\w-]+) -->\n).*?(<!-- /results-table -->)",
                    re.DOTALL)


def load_results(directory: Path = RESULTS_DIR) -> Dict[str, Doc]:
    """Every result file of ``directory``, by file stem (``handoff``, ``queue``, ...)."""
    return {p.stem: json.loads(p.read_text(encoding="utf-8"))
            for p in sorted(directory.glob("*.json"))}


# ---- formatting (Note [One run per claim]) --------------------------------------------------


def ratio(x: float, digits: int = 1) -> str:
    return f"{x:.{digits}f}x"


def span(values: Iterable[float], digits: int = 1) -> str:
    """``lo-hix`` of ratios (one value: ``vx``)."""
    vs = sorted(values)
    lo, hi = f"{vs[0]:.{digits}f}", f"{vs[-1]:.{digits}f}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def micros(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us"


def duration(seconds: float) -> str:
    """A table cell: us below 1 ms, ms below 1 s, then s."""
    if seconds < 1e-3:
        return micros(seconds)
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def mib(x: float) -> str:
    return f"{x:,.0f} MiB"


def rate(per_s: float) -> str:
    for suffix, scale in (("M", 1e6), ("k", 1e3)):
        if per_s >= scale:
            return f"{per_s / scale:.3g} {suffix}/s"
    return f"{per_s:.0f} /s"


def _size(n: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _table(header: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ---- one table per benchmark ----------------------------------------------------------------


def _cells(doc: Doc, *keys: str, value: str) -> Dict[Tuple[Any, ...], float]:
    return {tuple(r[k] for k in keys): r[value] for r in doc["rows"]}


def handoff_table(doc: Doc) -> str:
    t = _cells(doc, "series", "nbytes", value="median_s")
    sizes = doc["params"]["sizes"]
    born = [[_size(n), micros(t["tensor floor", n]),
             micros(t["tmx fd arena-born", n]), micros(t["torch fd pre-shared", n]),
             ratio(t["torch fd pre-shared", n] / t["tmx fd arena-born", n]),
             micros(t["tmx fs arena-born", n]), micros(t["torch fs pre-shared", n]),
             ratio(t["torch fs pre-shared", n] / t["tmx fs arena-born", n])] for n in sizes]
    fresh = [[_size(n), duration(t["memcpy floor", n]), duration(t["stdlib pickle (numpy)", n]),
              duration(t["tmx fd fresh", n]), duration(t["torch fd fresh", n]),
              ratio(t["torch fd fresh", n] / t["tmx fd fresh", n]),
              duration(t["tmx fs fresh", n]), duration(t["torch fs fresh", n]),
              ratio(t["torch fs fresh", n] / t["tmx fs fresh", n])] for n in sizes]
    return ("Already in shared memory (torch_mp_ext: `mp.empty`; torch: `share_memory_()`):\n\n"
            + _table(["size", "floor", "torch_mp_ext fd", "torch fd", "torch / ours",
                      "torch_mp_ext fs", "torch fs", "torch / ours"], born)
            + "\n\nAn ordinary tensor, sent for the first time:\n\n"
            + _table(["size", "memcpy", "stdlib pickle (numpy)", "torch_mp_ext fd", "torch fd",
                      "torch / ours", "torch_mp_ext fs", "torch fs", "torch / ours"], fresh))


_QUEUES = ("torch_mp_ext", "multiprocessing", "torch.multiprocessing")


def queue_table(doc: Doc) -> str:
    t = _cells(doc, "series", "items", "mode", value="median_items_per_s")
    work = list(dict.fromkeys((r["items"], r["mode"]) for r in doc["rows"]))
    rows = [[items, mode, *(rate(t[(q, items, mode)]) for q in _QUEUES),
             ratio(t[("torch_mp_ext", items, mode)] / t[("multiprocessing", items, mode)])]
            for items, mode in work]
    lat = {(r["series"], r["pinned"]): r["median_one_way_s"] for r in doc["latency_rows"]}
    names = list(dict.fromkeys(r["series"] for r in doc["latency_rows"]))
    latency = [[name, f"{lat[name, False] * 1e6:.1f} us", f"{lat[name, True] * 1e6:.1f} us"]
               for name in names]
    return (_table(["items", "mode", *_QUEUES, "torch_mp_ext / multiprocessing"], rows)
            + "\n\nOne-way latency of a small message, ping-pong (median):\n\n"
            + _table(["queue", "unpinned", "pinned, one CPU each"], latency))


def spawn_table(doc: Doc) -> str:
    t = _cells(doc, "series", "nprocs", "call", value="median_s")
    keys = sorted({(r["nprocs"], r["call"]) for r in doc["rows"]})
    rows = []
    for n, call in keys:
        base = t["torch.mp.spawn", n, call]
        rows.append([str(n), call, f"{base:.3f}"]
                    + [f"{t[s, n, call]:.3f} ({ratio(base / t[s, n, call])})"
                       for s in ("tmx spawn", "tmx forkserver")])
    return _table(["workers", "call", "torch.multiprocessing.spawn (s)",
                   "torch_mp_ext spawn (s)", "torch_mp_ext forkserver (s)"], rows)


def dataloader_table(doc: Doc) -> str:
    by = {(r["series"], r["start_method"]): r for r in doc["rows"]}
    rows = []
    for key in dict.fromkeys(r["start_method"] for r in doc["rows"]):
        d, o = by["default", key], by["torch_mp_ext", key]
        rows.append([key, f"{d['median_batches_per_s']:.0f}", f"{o['median_batches_per_s']:.0f}",
                     ratio(o["median_batches_per_s"] / d["median_batches_per_s"]),
                     f"{d['peak_pss_mib']:.0f} / {o['peak_pss_mib']:.0f}"])
    return _table(["workload, start method", "default batches/s", "torch_mp_ext batches/s",
                   "ratio", "peak PSS MiB, default / ours"], rows)


ZERO, COPY = "tmx zero-copy", "tmx copy"
QUEUE, GLOO = "torch.mp Queue (snapshot)", "gloo broadcast"
PUBLISH = "publish (one memcpy into the channel)"


def _exchange_cells(doc: Doc) -> Dict[Tuple[str, int, int], float]:
    """(series, MB, collectors) -> median seconds per version; floors without collectors
    ("memcpy") under collectors 0."""
    return {(r["series"], round(r["nbytes"] / 1e6), r.get("collectors", 0)): r["median_s"]
            for r in doc["rows"]}


def exchange_table(doc: Doc) -> str:
    t = _exchange_cells(doc)
    configs = sorted({(mb, n) for (_, mb, n) in t if n})
    rows = []
    one = configs[0][1]
    for mb, n in configs:
        zero = t.get((ZERO, mb, n))
        cells = [t.get((series, mb, n)) for series in (ZERO, COPY, QUEUE, GLOO, PUBLISH)]
        shown = ["—" if v is None else f"{v * 1e3:.1f}" for v in cells]

        def per(other: float | None, zero: float | None = zero) -> str:
            return ratio(zero / other) if zero and other else "—"

        queue = cells[2]
        rows.append([f"{mb}", f"{n}", *shown, f"{t[('memcpy', mb, 0)] * 1e3:.1f}",
                     ratio(queue / zero) if zero and queue else "—",
                     per(t.get((ZERO, mb, one))), per(cells[4])])
    return _table(["MB", "collectors", "zero-copy ms", "copy ms", "Queue snapshot ms",
                   "gloo ms", "publish ms (floor)", "memcpy ms (floor)",
                   "Queue / zero-copy", "zero-copy vs 1 collector", "zero-copy vs publish"],
                  rows)


def _growth(doc: Doc) -> Dict[Tuple[str, str], float]:
    """(variant, start method) -> (PSS at end - idle PSS) / dataset size."""
    by = {(r["series"], r["start_method"]): r for r in doc["rows"]}
    out = {}
    for (series, method), r in by.items():
        if series.startswith("idle"):
            continue
        idle = by["idle+tmx" if series in ("shared", "list+tmx") else "idle", method]
        out[series, method] = (r["median_end_pss_mib"] - idle["median_end_pss_mib"]) / r[
            "dataset_mib"]
    return out


def dataset_memory_table(doc: Doc) -> str:
    by = {(r["series"], r["start_method"]): r for r in doc["rows"]}
    growth = _growth(doc)
    rows = []
    for (series, method), g in growth.items():
        r, base = by[series, method], by["list", method]
        rows.append([series, method, mib(r["dataset_mib"]), mib(r["median_end_pss_mib"]),
                     ratio(g, 2), f"{r['median_samples_per_s']:,.0f}",
                     f"{r['median_first_batch_s']:.2f}",
                     ratio(base["median_first_batch_s"] / r["median_first_batch_s"])])
    return _table(["dataset", "start", "dataset size", "PSS at end", "growth factor",
                   "samples/s", "first batch (s)", "first batch vs list"], rows)


TABLES: Dict[str, Callable[[Doc], str]] = {
    "handoff": handoff_table, "queue": queue_table, "spawn": spawn_table,
    "dataloader": dataloader_table, "exchange": exchange_table,
    "dataset_memory": dataset_memory_table,
}


def machine_table(results: Dict[str, Doc]) -> str:
    """The machine and versions, once: each cell lists every value the runs report."""

    def cell(get: Callable[[Doc], str]) -> str:
        return ", ".join(dict.fromkeys(get(doc) for doc in results.values()))

    def system(doc: Doc) -> str:  # "Linux 6.18.44-fc-v857": the kernel's own build suffix goes
        name, _, release = doc["machine"]["system"].partition(" ")
        return f"{name} {'.'.join(release.split('.')[:2])}, {doc['machine']['arch']}"

    row = [cell(lambda d: f"{d['machine']['cpu']}, {d['machine']['cpus']} CPUs"),
           cell(lambda d: f"{d['machine']['memory_bytes'] / 2**30:.0f} GiB"), cell(system),
           *(cell(lambda d, k=k: d["versions"].get(k, "?")) for k in ("python", "torch", "numpy"))]
    return _table(["CPU", "memory", "system", "Python", "torch", "numpy"], [row])


def runs_table(results: Dict[str, Doc]) -> str:
    """When and how each result was made: the machine is stated once, above it."""
    rows = [[name, doc["created"][:10], f"`{command(doc, name)}`",
             f"{doc['machine'].get('loadavg', [0])[0]:.1f}"] for name, doc in results.items()]
    return _table(["results", "date", "command", "load at start"], rows)


def command(doc: Doc, name: str) -> str:
    """The command that wrote ``doc``, writing to ``docs/results/NAME.json`` (where it was
    copied) instead of the path it was run with."""
    return re.sub(r"--json \S+", f"--json docs/results/{name}.json", doc["command"])


# ---- the figures pages may quote ------------------------------------------------------------


def figures(results: Dict[str, Doc]) -> Dict[str, str]:
    """Every figure README.md and docs/index.md may quote, by name."""
    out: Dict[str, str] = {}
    h = _cells(results["handoff"], "series", "nbytes", value="median_s")
    sizes = results["handoff"]["params"]["sizes"]
    born = [h[s, n] for s in ("tmx fd arena-born", "tmx fs arena-born") for n in sizes]
    out["handoff.arena_born"] = f"{min(born) * 1e6:.0f}-{max(born) * 1e6:.0f} us"
    for strategy in ("fd", "fs"):
        out[f"handoff.vs_torch_{strategy}_pre_shared"] = span(
            h[f"torch {strategy} pre-shared", n] / h[f"tmx {strategy} arena-born", n]
            for n in sizes)
    out["handoff.fresh_vs_torch"] = span(
        h[f"torch {s} fresh", n] / h[f"tmx {s} fresh", n] for s in ("fd", "fs") for n in sizes)
    q = _cells(results["queue"], "series", "items", "mode", value="median_items_per_s")
    work = {(items, mode) for _, items, mode in q}
    out["queue.vs_multiprocessing"] = span(
        q[("torch_mp_ext", *w)] / q[("multiprocessing", *w)] for w in work)
    s = _cells(results["spawn"], "series", "nprocs", "call", value="median_s")
    n = max(n for _, n, _ in s)
    for call in ("cold", "warm"):
        out[f"spawn.forkserver_{call}"] = ratio(s["torch.mp.spawn", n, call]
                                                / s["tmx forkserver", n, call])
    d = _cells(results["dataloader"], "series", "start_method", value="median_batches_per_s")
    out["dataloader.vs_default"] = span(d["torch_mp_ext", k] / d["default", k]
                                        for _, k in d if _ == "default")
    e = _exchange_cells(results["exchange"])
    mb = min(m for (_, m, n) in e if n)  # the 100 MB rows
    out["exchange.vs_queue"] = ratio(e[QUEUE, mb, 3] / e[ZERO, mb, 3])
    out["exchange.vs_gloo"] = ratio(e[GLOO, mb, 3] / e[ZERO, mb, 3])
    out["exchange.copy_vs_queue"] = ratio(e[QUEUE, mb, 3] / e[COPY, mb, 3])
    out["exchange.16_vs_1"] = ratio(e[ZERO, mb, 16] / e[ZERO, mb, 1])
    out["exchange.16_vs_publish"] = ratio(e[ZERO, mb, 16] / e[PUBLISH, mb, 16])
    dm = results["dataset_memory"]
    growth = _growth(dm)
    rows = {(r["series"], r["start_method"]): r for r in dm["rows"]}
    for method in ("fork", "spawn"):
        out[f"dataset.shared_{method}"] = ratio(growth["shared", method], 2)
        out[f"dataset.list_{method}"] = ratio(growth["list", method], 2)
    out["dataset.store"] = mib(rows["shared", "fork"]["dataset_mib"])
    out["dataset.list"] = mib(rows["list", "fork"]["dataset_mib"])
    out["dataset.spawn_first_batch"] = ratio(rows["list", "spawn"]["median_first_batch_s"]
                                             / rows["shared", "spawn"]["median_first_batch_s"])
    return out


#: What a figure looks like in a page: a ratio, a range of ratios, a time or a size.
FIGURE_SHAPE = re.compile(r"(?<![\w.,-])\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?"
                          r"(?:x\b| ?(?:us|µs|ms|MiB)\b)")


def unbacked_figures(text: str, known: Iterable[str]) -> List[str]:
    """The figures in ``text`` that no result gives (Note [One run per claim])."""
    values = set(known)
    return [m.group(0) for m in FIGURE_SHAPE.finditer(text)
            if m.group(0).replace("µs", "us") not in values]


# ---- the page -------------------------------------------------------------------------------


def render_page(text: str, results: Dict[str, Doc]) -> str:
    """``text`` with every results table rewritten from ``results``."""

    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name in ("runs", "machine"):
            body = (runs_table if name == "runs" else machine_table)(results)
        elif name in TABLES and name in results:
            body = TABLES[name](results[name])
        else:
            raise KeyError(f"docs/results.md: no results for table {name!r} (known: "
                           f"machine, runs, {', '.join(n for n in TABLES if n in results)})")
        return f"{m.group(1)}{body}\n{m.group(3)}"

    return _BLOCK.sub(fill, text)


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="exit 1 if a table of docs/results.md differs from its JSON")
    mode.add_argument("--figures", action="store_true",
                      help="print every figure README.md and docs/index.md may quote")
    args = parser.parse_args(argv)
    results = load_results()
    if args.figures:
        for name, value in figures(results).items():
            print(f"{name:36} {value}")
        return 0
    text = PAGE.read_text(encoding="utf-8")
    new = render_page(text, results)
    if args.check:
        if new != text:
            print("docs/results.md: tables differ from docs/results/*.json; "
                  "run python tools/results_page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
