"""The tensor hand-off measurement shared by the demo and benchmarks/bench_tensor_transfer.py.

Each library runs in its own pair of processes (``handoff_worker.py``): torch's side never
imports torch_mp_ext, so torch's own reducers are measured. Trials are interleaved across
libraries, variants and sizes, and summarised by medians.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import IO, cast

__all__ = ["Variant", "FLOOR", "TENSOR_FLOOR", "VARIANTS", "run_handoff", "format_table",
           "human_size"]

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "handoff_worker.py")


@dataclass(frozen=True)
class Variant:
    lib: str  # "tmx", "torch", "stdlib" or "pipe" (the floors)
    variant: str  # "fresh", "preshared", "floor" or "tensor" (the tensor floor)
    strategy: str  # "file_descriptor" or "file_system"
    label: str


FLOOR = Variant("pipe", "floor", "-", "Python pipe floor")
"""64 bytes through os.write/os.read on a pipe, acknowledged like the tensor rows: the
least a Python hand-off can take here (issue 15's floor column)."""

TENSOR_FLOOR = Variant("pipe", "tensor", "-", "tensor floor")
"""Where the tensor lies, through the same pipe, and ``torch.frombuffer`` on a mapping both
sides already share (Note [Tensor floor] in handoff_worker.py): the least a tensor hand-off
can take, with no reference counted and nothing looked up."""

VARIANTS = [
    FLOOR,
    TENSOR_FLOOR,
    Variant("stdlib", "fresh", "-", "stdlib pickle (numpy)"),
    Variant("torch", "fresh", "file_descriptor", "torch fd fresh"),
    Variant("torch", "preshared", "file_descriptor", "torch fd pre-shared"),
    Variant("torch", "fresh", "file_system", "torch fs fresh"),
    Variant("torch", "preshared", "file_system", "torch fs pre-shared"),
    Variant("tmx", "fresh", "file_descriptor", "tmx fd fresh"),
    Variant("tmx", "preshared", "file_descriptor", "tmx fd arena-born"),
    Variant("tmx", "fresh", "file_system", "tmx fs fresh"),
    Variant("tmx", "preshared", "file_system", "tmx fs arena-born"),
]


class _Side:
    def __init__(self, lib: str, transport: str) -> None:
        env = dict(os.environ)
        # The worker runs as a script: make the package importable from its checkout too.
        root = os.path.dirname(os.path.dirname(_WORKER))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        env["OMP_NUM_THREADS"] = "1"  # Note [Idle OpenMP threads spin] in handoff_worker.py
        self.proc = subprocess.Popen(
            [sys.executable, _WORKER, lib, transport],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._stdin: IO[str] = cast(IO[str], self.proc.stdin)
        self._stdout: IO[str] = cast(IO[str], self.proc.stdout)
        self.ask({})  # wait for "ready"

    def ask(self, cmd: dict) -> dict:
        if cmd:
            self._stdin.write(json.dumps(cmd) + "\n")
            self._stdin.flush()
        line = self._stdout.readline()
        if not line:
            raise RuntimeError(f"hand-off worker {self.proc.args!r} exited ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        try:
            self._stdin.write(json.dumps({"op": "stop"}) + "\n")
            self._stdin.close()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


@dataclass
class Results:
    sizes: list[int]
    variants: list[Variant]
    seconds: dict = field(default_factory=dict)  # (label, nbytes) -> [seconds]
    memcpy: dict = field(default_factory=dict)  # nbytes -> seconds
    failures: list = field(default_factory=list)

    def median(self, label: str, nbytes: int) -> float:
        return statistics.median(self.seconds[(label, nbytes)])


def run_handoff(
    sizes: list[int],
    repeats: int,
    variants: list[Variant] = VARIANTS,
    transport: str = "simple",
    progress=None,
    warmups: int = 2,
) -> Results:
    """Runs interleaved trials: for each repeat, every size, every variant, one hand-off.

    The variants of each size run in a new random order every round (seeded, so a run can
    be repeated): the first trial after a 128 MB one pays for what that trial left behind
    (cache refills, the kernel's page work), and in a fixed order that was always the same
    variant's (the pipe floor's 4 KB cell read 24 us instead of 6 us)."""
    libs = sorted({v.lib for v in variants})
    sides = {lib: _Side(lib, transport) for lib in libs}
    results = Results(sizes, list(variants))
    try:
        # Any side but the pipe floor's, which answers every command with a pipe trial.
        memcpy_side = sides[next((lib for lib in libs if lib != FLOOR.lib), libs[0])]
        for nbytes in sizes:
            results.memcpy[nbytes] = memcpy_side.ask({"op": "memcpy", "nbytes": nbytes})[
                "seconds"
            ]
        seq = 0
        order = random.Random(15)
        for rep in range(-1, repeats):  # round -1 warms every path up and is not counted
            for nbytes in sizes:
                for v in order.sample(variants, len(variants)):
                    seq += 1
                    answer = sides[v.lib].ask(
                        {"op": "trial", "variant": v.variant, "strategy": v.strategy,
                         "nbytes": nbytes, "seq": seq, "warmups": warmups}
                    )
                    if not answer["ok"]:
                        results.failures.append((v.label, nbytes))
                    if rep >= 0:
                        results.seconds.setdefault((v.label, nbytes), []).append(
                            answer["seconds"])
            if progress is not None and rep >= 0:
                progress(rep + 1, repeats)
    finally:
        for side in sides.values():
            side.close()
    return results


def human_size(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _fmt(seconds: float) -> str:
    if seconds >= 1e-1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def format_table(results: Results) -> str:
    """A Markdown table: medians per size and variant, then the ratios that matter."""
    labels = [v.label for v in results.variants]
    head = ["size", "memcpy floor"] + labels
    rows = []
    for nbytes in results.sizes:
        row = [human_size(nbytes), _fmt(results.memcpy[nbytes])]
        row += [_fmt(results.median(label, nbytes)) for label in labels]
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    ratios = _ratios(results)
    if ratios:
        lines += ["", "| size | " + " | ".join(name for name, _ in ratios[0][1]) + " |",
                  "|---|" + "---|" * len(ratios[0][1])]
        for nbytes, items in ratios:
            lines.append(f"| {human_size(nbytes)} | "
                         + " | ".join(f"{value:.1f}x" for _, value in items) + " |")
    return "\n".join(lines)


def _ratios(results: Results) -> list:
    labels = {v.label for v in results.variants}
    pairs = [
        ("tmx fd arena-born / floor", "tmx fd arena-born", FLOOR.label),
        ("tmx fs arena-born / floor", "tmx fs arena-born", FLOOR.label),
        ("tmx fd arena-born / tensor floor", "tmx fd arena-born", TENSOR_FLOOR.label),
        ("tmx fs arena-born / tensor floor", "tmx fs arena-born", TENSOR_FLOOR.label),
        ("tmx fs / fd arena-born", "tmx fs arena-born", "tmx fd arena-born"),
        ("torch fd pre-shared / tmx fd arena-born", "torch fd pre-shared", "tmx fd arena-born"),
        ("torch fs pre-shared / tmx fs arena-born", "torch fs pre-shared", "tmx fs arena-born"),
        ("torch fd fresh / tmx fresh", "torch fd fresh", "tmx fd fresh"),
        ("torch fs fresh / tmx fresh", "torch fs fresh", "tmx fs fresh"),
        ("stdlib / tmx fresh", "stdlib pickle (numpy)", "tmx fd fresh"),
    ]
    pairs = [p for p in pairs if p[1] in labels and p[2] in labels]
    out = []
    for nbytes in results.sizes:
        out.append((nbytes, [(name, results.median(a, nbytes) / results.median(b, nbytes))
                             for name, a, b in pairs]))
    return out if pairs else []
