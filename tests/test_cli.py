"""The command line and the scripts around it run (their timings are never asserted)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.slow  # times the hand-off benchmark (8-18 s); the README's first command runs it
def test_demo_runs_and_checks_its_own_results():
    out = run("-m", "torch_mp_ext", "demo", "--quick", "--repeats", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "wrote into the parent's tensor: [42.0, 0.0, 0.0, 0.0]" in out.stdout
    assert "worker 1 now sees sum 132" in out.stdout
    assert "| tmx fd arena-born |" in out.stdout and "demo ok" in out.stdout


def test_doctor_reports_the_machine():
    out = run("-m", "torch_mp_ext", "doctor")
    assert out.returncode in (0, 1), out.stderr
    assert "/dev/shm:" in out.stdout and "RLIMIT_NOFILE" in out.stdout


@pytest.mark.slow  # a benchmark smoke run: 4-10 s, and only benchmarks/ depends on it
def test_tensor_transfer_benchmark_runs():
    out = run("benchmarks/bench_tensor_transfer.py", "--repeats", "1", "--sizes", "4KB,1MB")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| torch fd pre-shared |" in out.stdout and "WRONG DATA" not in out.stdout


@pytest.mark.slow  # a benchmark smoke run: 5-10 s, and only benchmarks/ depends on it
def test_pipeline_benchmark_runs_and_every_variant_agrees():
    out = run("benchmarks/bench_pipeline.py", "--arrays", "3", "--gil-arrays", "2",
              "--rounds", "1", "--gil-elements", "10")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("All sums equal: yes.") == 2, out.stdout
    assert "| torch.multiprocessing.Queue |" in out.stdout
    assert "| tmx pipeline workers=2 |" in out.stdout


@pytest.mark.slow  # a benchmark smoke run of the demo's hand-off floor (3-7 s)
def test_the_memcpy_floor_is_a_memcpy_whichever_side_answers_first():
    """The pipe floor's side answers every command with a pipe trial: the memcpy column
    once showed pipe trials (3.9 ms at 4 KB, 22 us at 16 MB)."""
    from torch_mp_ext_demo import handoff

    variants = [handoff.FLOOR, next(v for v in handoff.VARIANTS if v.lib == "tmx")]
    results = handoff.run_handoff([4 << 10, 8 << 20], 1, variants, warmups=0)
    assert results.failures == []
    assert results.memcpy[8 << 20] > 50 * results.memcpy[4 << 10], results.memcpy
