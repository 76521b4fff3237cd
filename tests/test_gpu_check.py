"""`make gpu-check` on a host without CUDA: it says that it checked nothing, and why, and does not pass."""
import subprocess
import sys

import pytest
import torch

from tests.service import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host: `make gpu-check` runs the real checks")
def test_gpu_check_without_cuda_skips_everything_and_says_why():
    r = subprocess.run([sys.executable, "-m", "bench.gpu_check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    rows = [line for line in r.stdout.splitlines() if "| skipped |" in line]
    assert len(rows) == 5 and all("no CUDA device here" in row for row in rows)
    assert "| torch |" in r.stdout and "0 checks run, 5 skipped" in r.stdout


@pytest.mark.slow
def test_the_service_check_runs_here_on_the_cpu():
    """The check's own code path (a real service, a job per device, /devices, a predict job) on the CPU,
    so that on its first GPU host only the device differs."""
    from bench import gpu_check
    ok, detail = gpu_check.service_job(["cpu"])
    assert ok, detail
    assert detail.startswith("cpu: acc ") and "predict ok" in detail


@pytest.mark.slow
def test_the_two_device_check_runs_here_on_two_cpu_workers():
    from bench import gpu_check
    ok, detail = gpu_check.two_device_job(["cpu", "cpu"])
    assert ok, detail
    assert detail.startswith("2 ranks on cpu, cpu: ") and "1 device: " in detail
