"""The command line and the scripts around it run (their timings are never asserted)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


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


def test_tensor_transfer_benchmark_runs():
    out = run("benchmarks/bench_tensor_transfer.py", "--repeats", "1", "--sizes", "4KB,1MB")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| torch fd pre-shared |" in out.stdout and "WRONG DATA" not in out.stdout


def test_pipeline_benchmark_runs_and_every_variant_agrees():
    out = run("benchmarks/bench_pipeline.py", "--arrays", "3", "--gil-arrays", "2",
              "--rounds", "1", "--gil-elements", "10")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("All sums equal: yes.") == 2, out.stdout
    assert "| torch.multiprocessing.Queue |" in out.stdout
    assert "| tmx pipeline workers=2 |" in out.stdout
