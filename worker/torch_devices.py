"""The torch side of devices, in the job process: resolve the device, apply the speed switches, read allocator stats.

Everything that touches torch.cuda lives here behind a device-type check, so the training loop never
calls torch.cuda itself and the CPU tests run the same code paths a GPU job does.
"""
from contextlib import nullcontext
from typing import Any, ContextManager

import torch
from torch import nn

from trainyard.app import device_names
from trainyard.app.spec import TrainParams
from trainyard.worker.context import JobError

# A dataset is copied to the GPU whole only when it takes less than this share of the free memory,
# leaving the rest for activations, gradients and optimizer state.
DATA_ON_DEVICE_SHARE = 0.5


def resolve(device: str) -> torch.device:
    """A worker's device name (app/device_names.py) -> torch.device, checking that the device exists."""
    index = device_names.cuda_index(device)
    if device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if index is None:
        if device != "cpu":
            raise JobError(f"unknown device {device!r}; use cpu, cuda or cuda:N")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise JobError(f"device {device!r} requested but CUDA is not available on this worker")
    count = torch.cuda.device_count()
    if index >= count:
        raise JobError(f"device {device!r} does not exist: this worker has {count} CUDA device(s)")
    return torch.device("cuda", index)


def limit_memory_fraction(device: torch.device, fraction: float | None) -> None:
    """Cap the share of the GPU's memory this process's caching allocator may take (other jobs may share
    the GPU, or the operator keeps room for others); an allocation past it is an out-of-memory error."""
    if device.type == "cuda" and fraction is not None and fraction < 1:
        torch.cuda.set_per_process_memory_fraction(fraction, device)


def configure(device: torch.device, params: TrainParams) -> dict[str, Any]:
    """Apply the process-wide switches the job asked for; return what was actually applied.

    channels_last and compile depend on the model, so train.py records them with
    use_channels_last() and compile_model() below.
    """
    applied: dict[str, Any] = {"notes": []}
    if device.type == "cuda":
        # Only the fp32_precision API: since PyTorch 2.9 mixing it with the legacy allow_tf32 flags
        # makes reading either of them raise.
        mode = "tf32" if params.tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode
        torch.backends.cudnn.benchmark = params.cudnn_benchmark
        applied["tf32"] = "on" if params.tf32 else "off"
        applied["cudnn_benchmark"] = "on" if params.cudnn_benchmark else "off"
    else:
        applied["tf32"] = "n/a (cpu)"
        applied["cudnn_benchmark"] = "n/a (cpu)"
    precision, note = resolve_precision(device, params.precision)
    applied["precision"] = precision
    if note:
        applied["notes"].append(note)
    return applied


def resolve_precision(device: torch.device, precision: str) -> tuple[str, str | None]:
    """The precision that will really be used on this device, and a note when it differs."""
    if precision == "fp16" and device.type != "cuda":
        return "fp32", "precision fp16 needs CUDA; ran in fp32 on the cpu (bf16 works on the cpu)"
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "fp32", f"precision bf16 is not supported by {torch.cuda.get_device_name(device)}; ran in fp32"
    return precision, None


def autocast(device: torch.device, precision: str) -> ContextManager:
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


# A CPU training step under this many floating-point operations (forward and backward) runs on one
# thread: its ops are too small to split, and waking the other threads for each of them costs more
# than they save, most of all while the worker's supervisor or another process has those cores
# (bench: iris 1.2x, cifar_net at batch 4 1.16x faster on one thread of two; at batch 64, 205 MFLOP
# a step, 1.4x faster on two).
SMALL_STEP_FLOPS = 50e6


def step_flops(model: nn.Module, sample: torch.Tensor, batch_size: int) -> int:
    """Floating-point operations of one training step's forward and backward, counted on a copy of the
    model on the meta device (nothing computed, nothing of the real model touched) for one sample in
    eval mode, and scaled to the batch."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode
    shadow = copy.deepcopy(model).to("meta").eval()
    with FlopCounterMode(display=False) as counter:
        shadow(sample[:1].to("meta")).float().sum().backward()
    return counter.get_total_flops() * batch_size


def fit_cpu_threads(model: nn.Module, sample: torch.Tensor, batch_size: int, device: torch.device,
                    applied: dict[str, Any]) -> None:
    """One thread for a CPU job whose steps are too small to share (SMALL_STEP_FLOPS); reported in applied."""
    if device.type != "cpu":
        return
    threads = torch.get_num_threads()
    if threads > 1:
        try:
            small = step_flops(model, sample, batch_size) < SMALL_STEP_FLOPS
        except Exception:  # noqa: BLE001 - a model the counter cannot run keeps its threads; training will tell
            small = False
        if small:
            torch.set_num_threads(threads := 1)
    applied["cpu_threads"] = threads


def compile_model(model: nn.Module, wanted: bool, example: torch.Tensor, applied: dict[str, Any]) -> nn.Module:
    """torch.compile the model, or return it unchanged (eager) with a note if compiling fails.

    Compilation is lazy, so one no-grad forward on `example` forces it here, where a missing
    toolchain can still be turned into a fallback rather than a failed job.
    """
    applied["compile"] = "off"
    if not wanted:
        return model
    was_training = model.training
    try:
        compiled = torch.compile(model)
        model.eval()
        with torch.no_grad():
            compiled(example)
    except Exception as e:  # noqa: BLE001 - any compiler failure means "run eager"
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        applied["notes"].append(f"torch.compile failed ({type(e).__name__}: {first_line}); ran eager")
        return model
    finally:
        model.train(was_training)
    applied["compile"] = "on"
    return compiled


def fits_on_device(nbytes: int, device: torch.device) -> bool:
    """Whether a dataset of nbytes should live on the device (always true for the cpu)."""
    if device.type != "cuda":
        return True
    free, _total = torch.cuda.mem_get_info(device)
    return nbytes < DATA_ON_DEVICE_SHARE * free


def memory_stats(device: torch.device) -> dict[str, int] | None:
    """CUDA caching-allocator stats in bytes; None on the cpu."""
    if device.type != "cuda":
        return None
    return {
        "memory_allocated": torch.cuda.memory_allocated(device),
        "memory_reserved": torch.cuda.memory_reserved(device),
        "max_memory_allocated": torch.cuda.max_memory_allocated(device),
        "max_memory_reserved": torch.cuda.max_memory_reserved(device),
    }


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def cuda_rng_state(device: torch.device) -> torch.Tensor | None:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_cuda_rng_state(device: torch.device, state: torch.Tensor | None) -> None:
    if device.type == "cuda" and state is not None:
        torch.cuda.set_rng_state(state, device)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_oom(device_name: str, batch_size: int, allocated: int, reserved: int, total: int) -> str:
    """The message of a job that ran out of GPU memory, from numbers (so it is testable without a GPU)."""
    return (
        f"CUDA out of memory on {device_name} with batch_size {batch_size}: "
        f"{_gib(allocated)} allocated, {_gib(reserved)} reserved by PyTorch, {_gib(total)} total. "
        f"Try a smaller batch_size (e.g. {max(1, batch_size // 2)}), or precision 'bf16' or 'fp16' "
        f"to halve activation memory."
    )


def oom_message(device: torch.device, batch_size: int) -> str:
    """format_oom() with the numbers read from torch.cuda at the time of failure."""
    if device.type != "cuda":
        return f"out of memory on {device} with batch_size {batch_size}; try a smaller batch_size"
    return format_oom(
        f"{device} ({torch.cuda.get_device_name(device)})", batch_size,
        torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
        torch.cuda.get_device_properties(device).total_memory,
    )
