"""The benchmark's image workloads (issue 39): ResNet-18 in bf16 autocast with channels_last, with and without
torch.compile, through the real service and the hand-written loop with the same numerics, and the model FLOPs
utilisation (bench/flops.py) each side is shown with."""
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from bench import flops, loops
from bench.cases import CASES, expand, spec_for
from bench.train_throughput import default_cases
from tests.helpers.service import ROOT
from trainyard.app.spec import parse_spec


def test_mfu_counts_a_linear_and_a_conv_layer_as_by_hand():
    """A Linear(10, 5) forward is 10 x 5 multiply-adds a sample, 100 FLOPs (the bias is no model FLOP); training
    3x that. A 3x3 conv from 3 to 8 channels over an 8x8 image without padding: 8 x 6 x 6 outputs of 27
    multiply-adds each."""
    assert flops.forward_flops(nn.Linear(10, 5), torch.zeros(4, 10)) == 4 * 2 * 10 * 5
    assert flops.train_flops_per_sample(nn.Linear(10, 5), (10,)) == 3 * 2 * 10 * 5
    assert flops.train_flops_per_sample(nn.Conv2d(3, 8, 3), (3, 8, 8)) == 3 * 2 * (8 * 6 * 6) * (3 * 3 * 3)
    h100 = flops.peak_flops("NVIDIA H100 80GB HBM3", "bf16", tf32=True)
    assert h100 == 989.5e12
    assert flops.mfu(1e9, 300, h100) == pytest.approx(300e9 / 989.5e12)
    assert flops.shown(flops.mfu(1e9, 300, h100)) == "0.03%"


@pytest.mark.parametrize("name, precision, tf32, tflops", [
    ("NVIDIA H200", "bf16", True, 989.5),
    ("NVIDIA H200 NVL", "bf16", True, 835.5),
    ("NVIDIA H100 PCIe", "fp32", True, 378.0),      # TF32 matmuls: the tensor cores' peak
    ("NVIDIA H100 PCIe", "fp32", False, 51.0),      # plain fp32
    ("NVIDIA A100-SXM4-80GB", "fp16", True, 312.0),
    ("NVIDIA L4", "bf16", True, 121.0),             # not L40's nor L40S's
    ("NVIDIA L40S", "bf16", True, 362.05),
    ("NVIDIA GeForce RTX 4090", "bf16", True, 165.2),
    ("NVIDIA A10G", "bf16", True, None),            # AWS's own SKU, not the A10's figures
    ("Tesla V100-SXM2-32GB", "bf16", True, None),   # no bf16 (the service runs fp32 there)
    ("cpu", "bf16", False, None),
])
def test_each_card_gets_its_own_peak(name, precision, tf32, tflops):
    peak = flops.peak_flops(name, precision, tf32)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))
    if peak is None:
        assert flops.shown(flops.mfu(1000.0, 1e9, peak)) == "n/a"


def test_the_compiled_image_case_is_asked_of_both_sides_alike():
    """torch.compile on a 2-core CPU takes minutes, so the compiled case runs for real on a GPU only (the GPU
    check's throughput step); here its arguments: the service and the loop get the same spec, which differs from
    the eager case in compile alone, and the hand-written loop compiles the model it trains (torch.compile is lazy:
    nothing compiles until a batch)."""
    eager, compiled = (parse_spec(spec_for(c, "cpu")) for c in ("resnet18-bf16-cl", "resnet18-bf16-cl-compile"))
    assert compiled.train.compile and not eager.train.compile
    assert compiled.train.model_dump(exclude={"compile"}) == eager.train.model_dump(exclude={"compile"})
    assert (compiled.train.precision, compiled.train.channels_last, compiled.model.arch) == ("bf16", True, "resnet18")
    gpu = spec_for("resnet18-bf16-cl-compile", "cuda:0")
    assert (gpu["train"]["batch_size"], gpu["data"]["size"], gpu["device"]) == (256, 12_800, "cuda:0")
    assert CASES["resnet18-bf16-cl-compile"]["data"]["size"] == 12_800  # spec_for left the case itself alone
    assert expand("image,resnet18-bf16-cl") == ["resnet18-bf16-cl", "resnet18-bf16-cl-compile"]
    assert "resnet18-bf16-cl-compile" in default_cases("cuda:0")
    assert "resnet18-bf16-cl-compile" not in default_cases("cpu") and "resnet18-bf16-cl" in default_cases("cpu")
    model, applied = nn.Linear(2, 2), {}
    forward = loops.compiled(model, True, applied)
    assert getattr(forward, "_orig_mod", None) is model and applied["compile"] == "on"
    assert loops.compiled(model, False, applied) is model and applied["compile"] == "off"


def table_row(stdout: str, case: str) -> list[str]:
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == case:
            return cells
    raise AssertionError(f"no row for {case} in:\n{stdout}")


@pytest.mark.slow
def test_resnet18_runs_through_the_service_and_the_loop_with_the_same_numerics():
    """bench.train_throughput's image case on the CPU at its small size: the real service (server, worker, job)
    and the hand-written loop each train ResNet-18 in bf16 autocast and channels_last with the fused optimizer,
    both at a finite rate, and print the same numerics; MFU is n/a on the CPU, its FLOPs counted all the same."""
    run = subprocess.run([sys.executable, "-m", "bench.train_throughput", "--quick", "--cases", "resnet18-bf16-cl",
                          "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    # The columns app/cli/gpu_steps.py's throughput step reads: case, yardstick, ratio at 0, 2 and 4.
    cells = table_row(run.stdout, "resnet18-bf16-cl")
    service, loop = (float(cells[i].replace(",", "")) for i in (1, 3))
    assert cells[2] == "tight" and cells[4].endswith("x")
    assert all(math.isfinite(v) and v > 0 for v in (service, loop))
    assert cells[-2:] == ["n/a", "n/a"]
    seen = dict(line[2:].split(": ", 1) for line in run.stdout.splitlines() if line.startswith("- resnet18"))
    assert seen["resnet18-bf16-cl service"] == seen["resnet18-bf16-cl tight"], seen
    for switch in ("precision bf16", "channels_last on", "compile off", "optimizer fused"):
        assert switch in seen["resnet18-bf16-cl tight"]
    assert seen["resnet18-bf16-cl"].startswith("222.1 MFLOP a sample; cpu: n/a")
