"""Turns benchmark results (``--json PATH`` of benchmarks/bench_*.py) into PNG plots.

    python tools/plot_benchmarks.py RESULTS.json [...] --out docs/img

One PNG per file, named after its benchmark (``handoff.png`` for bench_tensor_transfer, with
``-queue`` appended for ``--transport queue``; ``queue.png``, ``spawn.png``,
``dataloader.png``, ``exchange.png``, ``dataset_memory.png``). Each plot says under its title
the command and the machine that made it (no directories: those are the machine's), and
carries the SHA-256 of its JSON in the PNG's ``Source`` text chunk. Needs matplotlib (the
``docs`` extra); draws without a display (Agg).

- hand-off: median time from ``put()`` until the consumer holds the tensor vs tensor size,
  log-log, in two panels (``HANDOFF_PANELS``): tensors already in shared memory over the
  tensor floor, ordinary tensors over the memcpy floor; one line per library and strategy.
- queue: items/s per workload and queue (log scale), grouped bars.
- spawn: seconds to start N workers and join them, cold and warm, per way of starting.
- dataloader: batches/s per workload and start method, default context vs torch_mp_ext's
  (log scale).
- exchange: ms per version until every collector has it in its model vs collectors, one
  line per contender and state size, log-log; the publish memcpy and a memcpy as floors.
- dataset_memory: PSS of main + DataLoader workers at the end of an epoch per dataset and
  start method, with the idle workers' fixed cost dotted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from collections import defaultdict
from typing import Any, Callable

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # after choosing the backend
import matplotlib.ticker

FORMAT = "torch_mp_ext-bench/1"
OURS = ("tmx", "torch_mp_ext")  # series names starting with these are torch_mp_ext's


def load(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read()
    doc = json.loads(raw)
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a benchmark result of format {FORMAT!r} "
                         f"(got {doc.get('format')!r}); write one with --json PATH")
    if not doc.get("rows"):
        raise ValueError(f"{path}: has no rows")
    doc["_source"] = f"{os.path.basename(path)} sha256:{hashlib.sha256(raw).hexdigest()}"
    return doc


def command(doc: dict[str, Any]) -> str:
    """The command line, its ``--json`` output shown by file name only: the directory it was
    written to is the machine's, not the reader's."""
    return re.sub(r"(--json )\S*/", r"\1", doc["command"])


def provenance(doc: dict[str, Any]) -> str:
    """Two lines naming the command and the machine."""
    m, v = doc["machine"], doc["versions"]
    mem = f", {m['memory_bytes'] / 2**30:.0f} GiB" if m.get("memory_bytes") else ""
    load = f", load {m['loadavg'][0]:.1f}" if m.get("loadavg") else ""
    system = re.sub(r"^(\S+ \d+\.\d+)\S*", r"\1", m["system"])  # "Linux 6.18": no build tag
    return (f"{command(doc)}\n{m['cpu']}, {m['cpus']} CPUs{mem}, {system}{load}; "
            f"Python {v.get('python')}, torch {v.get('torch', '?')}; {doc['created'][:10]}")


def _figure(doc: dict[str, Any], title: str, width: float = 8.0,
            panels: int = 1) -> tuple[Any, Any]:
    fig, ax = plt.subplots(1, panels, figsize=(width, 5.2), squeeze=panels == 1)
    fig.suptitle(title, fontsize=12)
    fig.text(0.5, 0.005, provenance(doc), ha="center", va="bottom", fontsize=6.5,
             color="#555555", wrap=True)
    return fig, ax


def _style(series: str) -> dict[str, Any]:
    ours = series.startswith(OURS)
    return {"linewidth": 2.2 if ours else 1.3, "marker": "o" if ours else ".",
            "linestyle": "-" if ours else "--"}


def _save(fig: Any, path: str, doc: dict[str, Any]) -> str:
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    # Note [Plots name their source]: the SHA-256 of the JSON drawn, in the PNG's "Source"
    # text chunk, lets tests/test_docs_results.py prove a plot is of the results beside it.
    fig.savefig(path, dpi=110, metadata={"Source": doc["_source"], "Software": None})
    plt.close(fig)
    return path


def _human_bytes(n: float) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


#: The hand-off plot's panels: (title, floor series, the series drawn over it). At most six
#: lines a panel, one floor each: the variants a reader compares side by side.
HANDOFF_PANELS = (
    ("already in shared memory", "tensor floor",
     ("tmx fd arena-born", "tmx fs arena-born", "torch fd pre-shared", "torch fs pre-shared")),
    ("an ordinary tensor, sent for the first time", "memcpy floor",
     ("tmx fd fresh", "tmx fs fresh", "torch fd fresh", "torch fs fresh",
      "stdlib pickle (numpy)")),
)
#: One color per library and strategy, the same in both panels.
_COLORS = {"tmx fd": "tab:blue", "tmx fs": "tab:cyan", "torch fd": "tab:red",
           "torch fs": "tab:orange", "stdlib": "tab:purple"}
_LABELS = {"tmx": "torch_mp_ext", "fd": "file_descriptor", "fs": "file_system"}


def _handoff_label(series: str) -> str:
    """``tmx fd arena-born`` -> ``torch_mp_ext, file_descriptor``: the panel says the rest."""
    words = series.split()
    if words[0] not in ("tmx", "torch"):
        return series
    return f"{_LABELS.get(words[0], words[0])}, {_LABELS.get(words[1], words[1])}"


def plot_handoff(doc: dict[str, Any], path: str) -> str:
    transport = doc["params"].get("transport", "simple")
    fig, axes = _figure(doc, f"Tensor hand-off: put() until the consumer holds it "
                             f"(median, {transport} transport)", 11, panels=2)
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in doc["rows"]:
        series[row["series"]].append((row["nbytes"], row["median_s"]))
    sizes = sorted({row["nbytes"] for row in doc["rows"]})
    for ax, (title, floor, names) in zip(axes[0], HANDOFF_PANELS):
        for name in (floor, *names):
            if name not in series:
                continue
            points = sorted(series[name])
            xs, ys = [p[0] for p in points], [p[1] * 1e6 for p in points]
            if name == floor:
                ax.plot(xs, ys, color="grey", linestyle=":", linewidth=2, label=name)
                continue
            color = next((c for k, c in _COLORS.items() if name.startswith(k)), None)
            ax.plot(xs, ys, label=_handoff_label(name), color=color, **_style(name))
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [_human_bytes(s) for s in sizes])
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,g}")  # 200, not 2x10^2
        ax.yaxis.set_major_formatter(plain)
        low, high = ax.get_ylim()
        if high / low < 100:  # within two decades, label the minor ticks too
            ax.yaxis.set_minor_formatter(plain)
            ax.tick_params(axis="y", which="minor", labelsize=7)
        else:
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("tensor size")
        ax.set_ylabel("microseconds (log)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path, doc)


def _short(v: float) -> str:
    """3 significant digits with k/M: 1.99e+05 -> 199k."""
    for suffix, scale in (("M", 1e6), ("k", 1e3)):
        if v >= scale:
            return f"{v / scale:.3g}{suffix}"
    return f"{v:.3g}"


def _grouped_bars(ax: Any, groups: list[str], series: list[str],
                  value: Callable[[str, str], float | None]) -> None:
    width = 0.8 / max(len(series), 1)
    for i, name in enumerate(series):
        xs, ys = [], []
        for g, group in enumerate(groups):
            v = value(group, name)
            if v is not None:
                xs.append(g + (i - (len(series) - 1) / 2) * width)
                ys.append(v)
        bars = ax.bar(xs, ys, width, label=name,
                      edgecolor="black" if name.startswith(OURS) else None)
        ax.bar_label(bars, labels=[_short(y) for y in ys], fontsize=6, padding=1)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)


def _ordered(values: Any) -> list[str]:
    return list(dict.fromkeys(values))


def plot_queue(doc: dict[str, Any], path: str) -> str:
    fig, ax = _figure(doc, "Queue throughput, 1 producer -> 1 consumer (median items/s)", 9)
    rows = doc["rows"]
    groups = _ordered(f"{r['items']}\n{r['mode']}" for r in rows)
    series = _ordered(r["series"] for r in rows)
    cell = {(f"{r['items']}\n{r['mode']}", r["series"]): r["median_items_per_s"] for r in rows}
    _grouped_bars(ax, groups, series, lambda g, s: cell.get((g, s)))
    ax.set_yscale("log")
    ax.set_ylabel("items/s (log)")
    return _save(fig, path, doc)


def plot_spawn(doc: dict[str, Any], path: str) -> str:
    fig, ax = _figure(doc, "Start N workers running a tiny op and join them (median s)")
    rows = doc["rows"]
    groups = _ordered(f"N={r['nprocs']}, {r['call']}" for r in
                      sorted(rows, key=lambda r: (r["nprocs"], r["call"])))
    series = _ordered(r["series"] for r in rows)
    cell = {(f"N={r['nprocs']}, {r['call']}", r["series"]): r["median_s"] for r in rows}
    _grouped_bars(ax, groups, series, lambda g, s: cell.get((g, s)))
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log)")
    return _save(fig, path, doc)


def plot_dataloader(doc: dict[str, Any], path: str) -> str:
    fig, ax = _figure(doc, "DataLoader throughput (median batches/s)", 6.5)
    rows = doc["rows"]
    groups = _ordered(r["start_method"] for r in rows)
    series = _ordered(r["series"] for r in rows)
    cell = {(r["start_method"], r["series"]): r["median_batches_per_s"] for r in rows}
    _grouped_bars(ax, groups, series, lambda g, s: cell.get((g, s)))
    ax.set_yscale("log")  # workload (a) runs 20x the batches of (b)
    ax.set_ylabel("batches/s (log)")
    ax.set_xlabel("workload and start method")
    ax.tick_params(axis="x", labelrotation=20)  # "(row) method" labels are long
    return _save(fig, path, doc)


def plot_exchange(doc: dict[str, Any], path: str) -> str:
    rows = doc["rows"]
    if not any("collectors" in r for r in rows):  # results from before issue 32: one size, N=3
        return _plot_exchange_bars(doc, path)
    fig, ax = _figure(doc, "Model exchange: ms per version until every collector has it "
                           "in its model (median)")
    sizes = sorted({r["nbytes"] for r in rows})
    dashes = ["-", "--", "-.", ":"]
    for k, nbytes in enumerate(sizes):
        label = f"{nbytes / 1e6:.0f} MB"
        here = [r for r in rows if r["nbytes"] == nbytes]
        for name in _ordered(r["series"] for r in here if not r.get("floor")):
            points = sorted((r["collectors"], r["median_s"] * 1e3) for r in here
                            if r["series"] == name)
            style = _style(name)
            style["linestyle"] = dashes[k % len(dashes)]
            ax.plot([x for x, _ in points], [y for _, y in points], label=f"{name}, {label}",
                    **style)
        for r in here:
            if r.get("floor") and "collectors" not in r:
                ax.axhline(r["median_s"] * 1e3, color="grey", linestyle=":", linewidth=1.5,
                           label=f"{r['series']} floor, {label} ({r['median_s'] * 1e3:.1f} ms)")
        publish = sorted((r["collectors"], r["median_s"] * 1e3) for r in here
                         if r.get("floor") and "collectors" in r)
        if publish:
            ax.plot([x for x, _ in publish], [y for _, y in publish], color="grey",
                    linestyle="--", linewidth=1.5, label=f"publish (memcpy), {label}")
    counts = sorted({r["collectors"] for r in rows if "collectors" in r})
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.set_yscale("log")
    ax.set_xlabel("collectors")
    ax.set_ylabel("ms (log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6.5, ncol=2)
    return _save(fig, path, doc)


def _plot_exchange_bars(doc: dict[str, Any], path: str) -> str:
    nbytes = doc["rows"][0]["nbytes"]
    collectors = doc["params"].get("collectors", "?")
    fig, ax = _figure(doc, f"Model exchange: a {nbytes / 1e6:.0f} MB state_dict to "
                           f"{collectors} collectors (median ms)")
    rows = [r for r in doc["rows"] if not r.get("floor")]
    names = [r["series"] for r in rows]
    ms = [r["median_s"] * 1e3 for r in rows]
    colors = ["tab:blue" if n.startswith(OURS) else "tab:orange" for n in names]
    bars = ax.barh(names, ms, color=colors)
    ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
    for r in doc["rows"]:
        if r.get("floor"):
            ax.axvline(r["median_s"] * 1e3, color="grey", linestyle=":", linewidth=2,
                       label=f"{r['series']} ({r['median_s'] * 1e3:.1f} ms)")
            ax.legend(fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms until every collector has loaded it")
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path, doc)


def plot_dataset_memory(doc: dict[str, Any], path: str) -> str:
    records = doc["params"].get("records", "?")
    workers = doc["params"].get("workers", "?")
    fig, ax = _figure(doc, f"DataLoader over {records:,} Python records, {workers} workers:\n"
                           "PSS of main + workers at the end of an epoch (MiB)"
                      if isinstance(records, int) else "Dataset memory (MiB)", 8)
    rows = doc["rows"]
    groups = _ordered(r["start_method"] for r in rows)
    series = [s for s in _ordered(r["series"] for r in rows) if not s.startswith("idle")]
    cell = {(r["start_method"], r["series"]): r["median_end_pss_mib"] for r in rows}
    _grouped_bars(ax, groups, series, lambda g, s: cell.get((g, s)))
    for i, g in enumerate(groups):  # the fixed cost of the main process and idle workers
        idle = cell.get((g, "idle"))
        if idle is not None:
            ax.hlines(idle, i - 0.45, i + 0.45, colors="grey", linestyles=":",
                      label="main + idle workers" if i == 0 else None)
    ax.legend(fontsize=8)
    ax.set_ylabel("PSS at the end of the epoch (MiB)")
    ax.set_xlabel("start method")
    return _save(fig, path, doc)


PLOTS: dict[str, tuple[str, Callable[[dict[str, Any], str], str]]] = {
    "bench_tensor_transfer": ("handoff", plot_handoff),
    "bench_queue": ("queue", plot_queue),
    "bench_spawn": ("spawn", plot_spawn),
    "bench_dataloader": ("dataloader", plot_dataloader),
    "bench_exchange": ("exchange", plot_exchange),
    "bench_dataset_memory": ("dataset_memory", plot_dataset_memory),
}


def plot_file(path: str, out_dir: str) -> str:
    """Plots one result file into ``out_dir``; returns the PNG's path."""
    doc = load(path)
    if doc["benchmark"] not in PLOTS:
        raise ValueError(f"{path}: no plot for benchmark {doc['benchmark']!r} "
                         f"(known: {', '.join(PLOTS)})")
    stem, plot = PLOTS[doc["benchmark"]]
    if doc["benchmark"] == "bench_tensor_transfer" and doc["params"].get("transport") == "queue":
        stem += "-queue"
    os.makedirs(out_dir, exist_ok=True)
    return plot(doc, os.path.join(out_dir, f"{stem}.png"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="JSON files written by a benchmark's --json")
    parser.add_argument("--out", default=os.path.join("docs", "img"),
                        help="directory for the PNGs (default docs/img)")
    args = parser.parse_args(argv)
    for path in args.results:
        try:
            print(plot_file(path, args.out))
        except (OSError, ValueError, KeyError) as e:
            print(f"plot_benchmarks: {path}: {e!r}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
