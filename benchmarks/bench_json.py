"""Benchmark results as JSON: ``--json PATH`` for every benchmark, read by the plot script.

One file per run::

    {"format": "torch_mp_ext-bench/1", "benchmark": "bench_queue",
     "command": "python benchmarks/bench_queue.py --rounds 5 --json q.json",
     "created": "2026-12-01T14:00:00Z", "machine": {...}, "versions": {...},
     "params": {...}, "rows": [{...}, ...]}

Also the helpers the benchmarks share (:func:`pss_kib`).

``rows`` holds every measured cell as a flat dict (the columns differ per benchmark; each
documents its own in ``rows_doc``); ``tools/plot_benchmarks.py`` turns files into PNG plots.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from typing import Any

FORMAT = "torch_mp_ext-bench/1"


def add_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--json PATH`` to a benchmark's parser."""
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write every row, the machine and the command line as JSON "
                             "(for tools/plot_benchmarks.py)")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def machine() -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, memory, kernel, load when the run started."""
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": _memory_bytes(),
        "arch": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
        "loadavg": load,
    }


_AT_START = machine()  # the load average before the benchmark itself adds to it


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "numpy", "torch_mp_ext"):
        module = sys.modules.get(name)
        if module is not None:
            out[name] = str(getattr(module, "__version__", "?"))
    return out


def command_line() -> str:
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)


def write(path: str, benchmark: str, rows: list[dict[str, Any]], *,
          params: dict[str, Any] | None = None, rows_doc: str = "",
          machine_info: dict[str, Any] | None = None,
          extra: dict[str, Any] | None = None) -> None:
    """Writes one run's results to ``path`` (atomically: a partial file never appears)."""
    doc = {
        "format": FORMAT,
        "benchmark": benchmark,
        "command": command_line(),
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine_info or _AT_START,
        "versions": versions(),
        "params": params or {},
        "rows_doc": rows_doc,
        "rows": rows,
        **(extra or {}),  # further tables of the same run (bench_queue's latency_rows)
    }
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    print(f"results written to {path}", file=sys.stderr)


def pss_kib(pid: int) -> int:
    """Proportional set size of ``pid`` in KiB (shared pages counted once); 0 once gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
