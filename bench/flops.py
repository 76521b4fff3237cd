"""Model FLOPs utilisation (MFU) for the benchmarks: a model's training FLOPs per sample, counted, and the
dense peak of the card it ran on, from the datasheets by GPU name.

MFU = training FLOPs per sample x samples/s / the card's peak for the arithmetic the matmuls ran in (PaLM's
definition, appendix B: the model's FLOPs, not the hardware's, so recomputation or a slow kernel counts against
it). Training FLOPs are 3x the forward's (the backward computes the gradients of the inputs and of the weights,
each about a forward), and the forward's are counted by torch.utils.flop_counter: matrix multiplications and
convolutions, 2 per multiply-add; the elementwise ops (BatchNorm, ReLU, pooling) are not model FLOPs. No peak
(the CPU, an unknown card): no MFU, shown as "n/a".
"""
import copy
import re

import torch
from torch import nn

# Dense (no 2:4 sparsity) peak TFLOPS by arithmetic: bf16 and fp16 on the tensor cores with fp32 accumulation
# (what autocast asks for), tf32 on the tensor cores, and plain fp32 on the CUDA cores. The datasheets list the
# tensor-core figures "with sparsity" (marked *), twice these. Sources:
# - H100 SXM / PCIe / NVL: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100):
#   FP32 67 / 51 / 60; TF32 989* / 756* / 835*; BF16 and FP16 1,979* / 1,513* / 1,671*.
# - H200 SXM / NVL: NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): as H100 SXM / NVL. GH200: the
#   GH200 Grace Hopper datasheet, the H100 SXM's figures.
# - A100 (SXM and PCIe, 40 and 80 GB): NVIDIA A100 datasheet: FP32 19.5; TF32 156; BF16 and FP16 312.
# - A10: NVIDIA A10 datasheet: FP32 31.2; TF32 62.5; BF16 and FP16 125. (AWS's A10G differs: not listed.)
# - L4: NVIDIA L4 datasheet: FP32 30.3; TF32 120*; BF16 and FP16 242*.
# - L40S: NVIDIA L40S datasheet: FP32 91.6; TF32 183; BF16 and FP16 362.05. L40: FP32 90.5; TF32 90.5;
#   BF16 and FP16 181.05 (NVIDIA L40 datasheet).
# - GeForce RTX 4090: NVIDIA Ada Lovelace architecture whitepaper v1.01, appendix A: FP32 82.6; TF32 82.6;
#   BF16 and FP16 with FP32 accumulate 165.2 (GeForce cards run fp32 accumulation at half the fp16 rate).
# - GeForce RTX 3090: NVIDIA Ampere GA102 whitepaper v2.1, appendix A: FP32 35.6; TF32 35.6; BF16 and FP16
#   with FP32 accumulate 71.
# - V100 SXM2 / PCIe: NVIDIA V100 datasheet: FP32 15.7 / 14; FP16 tensor 125 / 112; no TF32 nor bf16 (the
#   service runs bf16 jobs there in fp32, switches.choose_precision). T4: NVIDIA T4 datasheet: FP32 8.1;
#   FP16 65.
# The first pattern that matches torch.cuda.get_device_name() wins: the NVL and PCIe variants before the SXM.
_PEAKS: list[tuple[str, dict[str, float]]] = [
    (r"\bH[12]00 NVL\b", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH100 PCIe\b", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    (r"\b(GH200|H100|H200)\b", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    (r"\bA100\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bL40S\b", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL40\b", {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5}),
    (r"\bRTX 4090\b", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"\bRTX 3090\b", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    (r"\bV100-PCIE\b", {"fp16": 112.0, "tf32": 14.0, "fp32": 14.0}),
    (r"\bV100\b", {"fp16": 125.0, "tf32": 15.7, "fp32": 15.7}),
    (r"\bT4\b", {"fp16": 65.0, "tf32": 8.1, "fp32": 8.1}),
]


def peak_flops(device_name: str, precision: str, tf32: bool) -> float | None:
    """The card's dense peak in FLOP/s for a step in `precision` (the one applied: bf16, fp16 or fp32; fp32 runs
    its matmuls in TF32 when `tf32`), or None: the CPU, a card not in the table, an arithmetic it lacks."""
    kind = "tf32" if precision == "fp32" and tf32 else precision
    for pattern, peaks in _PEAKS:
        if re.search(pattern, device_name, re.IGNORECASE):
            tflops = peaks.get(kind)
            return None if tflops is None else tflops * 1e12
    return None


def forward_flops(model: nn.Module, batch: torch.Tensor) -> int:
    """FLOPs of one forward pass of `batch` through model, as torch.utils.flop_counter counts them, on a copy
    of the model on the meta device (nothing computed, the real model untouched), in eval mode."""
    from torch.utils.flop_counter import FlopCounterMode
    shadow = copy.deepcopy(model).to("meta").eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        shadow(batch.to("meta"))
    return counter.get_total_flops()


def train_flops_per_sample(model: nn.Module, input_shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
    """Model FLOPs of training on one sample of input_shape: 3x its forward's."""
    return 3 * forward_flops(model, torch.zeros((1, *input_shape), dtype=dtype))


def mfu(samples_per_s: float, flops_per_sample: float, peak: float | None) -> float | None:
    """The share of the peak that samples_per_s training samples a second use (None without a peak)."""
    return None if not peak else samples_per_s * flops_per_sample / peak


def shown(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.2f}%"


def device_name(device: torch.device) -> str:
    """The name the peaks are looked up by: the card's as torch reports it, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
