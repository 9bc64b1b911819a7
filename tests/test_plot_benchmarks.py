"""Benchmarks write ``--json`` results that ``tools/plot_benchmarks.py`` turns into PNGs.

A real, tiny run of ``bench_queue.py`` (a couple of seconds) checks the JSON a benchmark
writes and plots it; ``tests/data/bench/*.json`` are results of real quick runs of the six
plotted benchmarks (``--repeats 1`` and small sizes), so every plot is drawn from the format
the benchmarks actually write without running the slow ones here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = sorted((ROOT / "tests" / "data" / "bench").glob("*.json"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytest.importorskip("matplotlib", reason="pip install -e '.[docs]' (or '.[test]')")
SCRIPT = ROOT / "tools" / "plot_benchmarks.py"
FORMAT = "torch_mp_ext-bench/1"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _is_png(path: str | Path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == PNG_MAGIC and os.path.getsize(path) > 10_000


def plot(files: list, out: Path) -> subprocess.CompletedProcess:
    """Runs the plot script (in a process of its own: matplotlib keeps its fonts open)."""
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, files), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # a benchmark smoke run, then matplotlib (5-12 s)
def test_quick_benchmark_run_writes_json_that_plots(tmp_path):
    out = tmp_path / "queue.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_queue.py"), "--rounds", "1",
           "--small-items", "500", "--big-items", "4", "--huge-items", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["format"] == FORMAT and doc["benchmark"] == "bench_queue"
    assert "bench_queue.py --rounds 1" in doc["command"] and "--json" in doc["command"]
    assert doc["versions"]["torch"] and doc["machine"]["cpus"] == os.cpu_count()
    libs = {r["series"] for r in doc["rows"]}
    assert {"torch_mp_ext", "multiprocessing", "torch.multiprocessing"} <= libs
    assert all(r["median_items_per_s"] > 0 for r in doc["rows"])
    # 4 workloads: int and small tuple twice (put/get, batched), 1 MB and 64 MB once
    assert len(doc["rows"]) == 6 * len(libs)

    done = plot([out], tmp_path / "img")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tmp_path / "img" / "queue.png")]
    assert _is_png(tmp_path / "img" / "queue.png")


@pytest.mark.slow  # draws every plot with matplotlib (3-6 s); only tools/ depends on it
def test_every_plot_from_real_results(tmp_path):
    benchmarks = {json.loads(f.read_text())["benchmark"] for f in FIXTURES}
    assert benchmarks == {"bench_tensor_transfer", "bench_queue", "bench_spawn",
                          "bench_dataloader", "bench_exchange", "bench_dataset_memory"}
    handoff = json.loads((ROOT / "tests" / "data" / "bench" / "transfer.json").read_text())
    assert any(r.get("floor") for r in handoff["rows"])  # the memcpy floor is plotted
    done = plot(FIXTURES, tmp_path)
    assert done.returncode == 0, done.stderr
    pngs = sorted(tmp_path.glob("*.png"))
    assert [p.name for p in pngs] == [
        "dataloader.png", "dataset_memory.png", "exchange.png", "handoff.png", "queue.png",
        "spawn.png"]
    assert all(_is_png(p) for p in pngs)


def test_bad_input_is_refused_with_the_fix(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    fail = plot([bad], tmp_path)
    assert fail.returncode == 1 and "write one with --json PATH" in fail.stderr
    assert not list(tmp_path.glob("*.png"))
