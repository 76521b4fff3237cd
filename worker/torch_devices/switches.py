"""The speed switches a train job asks for, applied to the process: tf32, cuDNN autotuning, determinism,
mixed precision (autocast, the fp16 GradScaler) and channels_last. What was really applied goes into
the job's result (`applied`), with a note wherever it differs from what was asked.
"""
import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from trainyard.app.spec import TrainParams

# bf16 runs natively from compute capability 8.0 (Ampere); below it (V100 7.0, T4 7.5) torch emulates it,
# slower than fp32, so such a card runs the job in fp32 and says so.
BF16_MIN_CAPABILITY = (8, 0)


def configure(device: torch.device, params: TrainParams) -> dict[str, Any]:
    """Apply the process-wide switches the job asked for; return what was actually applied.

    channels_last and compile depend on the model, so train.py records them with
    use_channels_last() below and compile_model() (torch_devices/step.py).
    """
    applied: dict[str, Any] = {"notes": []}
    if device.type == "cuda":
        # Only the fp32_precision API: since PyTorch 2.9 mixing it with the legacy allow_tf32 flags
        # makes reading either of them raise.
        mode = "tf32" if params.tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = mode
        # PyTorch 2.9's per-backend fp32_precision: torch's own type hints do not declare cudnn.conv yet.
        torch.backends.cudnn.conv.fp32_precision = mode  # type: ignore[attr-defined]
        # cuDNN's autotuner may pick another algorithm on the next run: not with deterministic
        # (app/spec/ refuses the two together; an older stored spec may still carry both).
        benchmark = params.cudnn_benchmark and not params.deterministic
        torch.backends.cudnn.benchmark = benchmark
        torch.backends.cudnn.deterministic = params.deterministic
        applied["tf32"] = "on" if params.tf32 else "off"
        applied["cudnn_benchmark"] = "on" if benchmark else "off"
    else:
        applied["tf32"] = "n/a (cpu)"
        applied["cudnn_benchmark"] = "n/a (cpu)"
    if params.deterministic:
        # An op with no deterministic implementation then raises, naming itself: the job fails `job`.
        torch.use_deterministic_algorithms(True)
        applied["deterministic"] = "on"
        if device.type == "cuda":
            applied["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    else:
        applied["deterministic"] = "off"
    precision, note = resolve_precision(device, params.precision)
    applied["precision"] = precision
    if note:
        applied["notes"].append(note)
    return applied


def resolve_precision(device: torch.device, precision: str) -> tuple[str, str | None]:
    """The precision that will really be used on this device, and a note when it differs. On CUDA it
    reads the job's own card (not the current device, which torch.cuda.is_bf16_supported() reads)."""
    if device.type == "cuda" and precision == "bf16":
        return choose_precision(precision, "cuda", torch.cuda.get_device_capability(device),
                                torch.cuda.get_device_name(device))
    return choose_precision(precision, device.type)


def choose_precision(precision: str, device_type: str, capability: tuple[int, int] | None = None,
                     name: str = "") -> tuple[str, str | None]:
    """resolve_precision() from numbers: a card's compute capability and name (testable without a GPU)."""
    if precision == "fp16" and device_type != "cuda":
        return "fp32", "precision fp16 needs CUDA; ran in fp32 on the cpu (bf16 works on the cpu)"
    if precision == "bf16" and device_type == "cuda" and tuple(capability or (0, 0)) < BF16_MIN_CAPABILITY:
        major, minor = capability or (0, 0)
        return "fp32", (f"precision bf16 needs compute capability 8.0 or newer; {name} is {major}.{minor} "
                        f"(it would only emulate bf16, slower than fp32); ran in fp32 (fp16 works there)")
    return precision, None


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """A fresh autocast context for one forward pass (nullcontext in fp32)."""
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """A GradScaler, enabled only for fp16 (disabled it passes losses and steps straight through)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16" and device.type == "cuda")


def use_channels_last(wanted: bool, input_shape: tuple[int, ...], applied: dict[str, Any]) -> bool:
    """channels_last only helps 4-D (image) batches; record what was decided."""
    ok = wanted and len(input_shape) == 3
    applied["channels_last"] = "on" if ok else "off"
    if wanted and not ok:
        applied["notes"].append("channels_last applies to image inputs only; ignored")
    return ok

