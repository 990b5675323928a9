"""benchmarks/gpu_check.py, the script a lent GPU runs first: its dry run on the CPU passes, so GPU time is not spent
on a broken script (what it checks on CUDA is only known there)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_gpu_check_runs_every_check_on_the_cpu():
    proc = run_check("--device", "cpu", "--no-smollm2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    passed = [line for line in lines if line.startswith("[PASS]")]
    for comp in ("fp16", "int8", "nf4"):  # bitsandbytes is in the test environment: nothing of these is skipped
        assert any(f"hook cpu tiny {comp}" in line for line in passed), proc.stdout
        assert any(f"eagle3 head cpu tiny {comp}" in line for line in passed), proc.stdout
    assert not any(line.startswith("[FAIL]") for line in lines)
    assert lines[-1].startswith("ALL PASSED")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_without_cuda_the_gpu_check_stops_at_once_and_names_the_dry_run():
    proc = run_check()
    assert proc.returncode == 1
    assert "[FAIL] cuda available" in proc.stdout and "--device cpu" in proc.stdout


def test_the_gpu_check_shell_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")]).returncode == 0
