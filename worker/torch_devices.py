"""The torch side of devices, in the job process: resolve the device, apply the speed switches, read allocator stats.

Everything that touches torch.cuda lives here behind a device-type check, so the training loop never
calls torch.cuda itself and the CPU tests run the same code paths a GPU job does.
"""
import os
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
# bf16 runs natively from compute capability 8.0 (Ampere); below it (V100 7.0, T4 7.5) torch emulates it,
# slower than fp32, so such a card runs the job in fp32 and says so.
BF16_MIN_CAPABILITY = (8, 0)
# What cuBLAS needs to be deterministic (train.deterministic), read when the process creates its handle.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def use_device(device: torch.device) -> None:
    """Make the job's device the process's current one, first thing in a CUDA job process. Otherwise the
    current device stays GPU 0: whatever reads it (a run job's .cuda(), a library's default, a stream)
    lands on GPU 0, maybe another job's card, and creates a CUDA context there."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def prepare_deterministic(on: bool) -> None:
    """Before CUDA is initialised in the job process: cuBLAS reads CUBLAS_WORKSPACE_CONFIG once, when
    the process first uses it, and without it deterministic algorithms refuse cuBLAS matmuls."""
    if on and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG


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
        raise DeviceFailure(f"device {device!r} requested but CUDA is not available on this worker")
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceFailure(f"device {device!r} does not exist: this worker has {count} CUDA device(s)")
    return torch.device("cuda", index)


class DeviceFailure(RuntimeError):
    """The worker's device cannot be used (CUDA gone, the device missing or failed): the host's trouble,
    not the job's. An `infrastructure` failure, retried on another worker; this worker takes no more."""


# Words of CUDA's and torch's errors that say the device or its driver failed, not the job's code.
DEVICE_FAILURES = ("uncorrectable ECC error", "busy or unavailable", "no CUDA-capable device is detected",
                   "driver version is insufficient", "CUDA driver initialization failed", "fallen off the bus",
                   "Found no NVIDIA driver", "system not yet initialized", "CUDA error: initialization error")


def is_device_failure(exc: BaseException) -> bool:
    """Whether an exception of a running job is its device failing (an `infrastructure` failure)."""
    return isinstance(exc, DeviceFailure) or (isinstance(exc, RuntimeError)
                                              and any(words in str(exc) for words in DEVICE_FAILURES))


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
        # cuDNN's autotuner may pick another algorithm on the next run: not with deterministic
        # (spec.py refuses the two together; an older stored spec may still carry both).
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
        except Exception:
            small = False
        if small:
            torch.set_num_threads(threads := 1)
    applied["cpu_threads"] = threads


def warm_up_batch(x: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    """A batch as the training loop hands it to the model: on the device (a dataset kept in host memory
    is copied per batch) and in channels_last when the job runs in it."""
    x = x.to(device)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def compile_model(model: nn.Module, wanted: bool, example: torch.Tensor, applied: dict[str, Any]) -> nn.Module:
    """torch.compile the model, or return it unchanged (eager) if compiling fails, saying why.

    Compilation is lazy, so one forward on `example` (warm_up_batch()) forces it here, where a missing
    toolchain can still be turned into a fallback rather than a failed job. The forward runs as
    training will (train mode, autograd on), so the graph compiled here is the one training uses; it
    leaves no trace: BatchNorm's running statistics and the random streams (dropout) are put back, so
    a compiled run draws what an eager one does. applied["compile"]: "on" (the compiled warm-up ran),
    "off" (not asked) or "fell back to eager" (with the reason in applied["compile_error"]).
    """
    applied["compile"] = "off"
    if not wanted:
        return model
    was_training = model.training
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    rng, device_rng = torch.get_rng_state(), cuda_rng_state(example.device)
    try:
        compiled = torch.compile(model)
        model.train()
        # DDP: no gradient sync is prepared for a backward that never comes.
        with (model.no_sync() if isinstance(model, nn.parallel.DistributedDataParallel) else nullcontext()):
            compiled(example)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        applied["compile"] = "fell back to eager"
        applied["compile_error"] = f"{type(e).__name__}: {first_line}"
        applied["notes"].append(f"torch.compile failed ({type(e).__name__}: {first_line}); ran eager")
        return model
    finally:
        model.train(was_training)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        torch.set_rng_state(rng)
        set_cuda_rng_state(example.device, device_rng)
    applied["compile"] = "on"
    return compiled


def data_fits_device(nbytes: int, device: torch.device) -> bool:
    """Whether a dataset of nbytes should live on the device (always true for the cpu): fits_on_device()
    with the card's free memory and this job's own budget read now."""
    if device.type != "cuda":
        return True
    free, total = torch.cuda.mem_get_info(device)
    return fits_on_device(nbytes, free, job_budget(torch.cuda.get_per_process_memory_fraction(device), total,
                                                   torch.cuda.memory_reserved(device)))


def job_budget(fraction: float, total: int, reserved: int) -> int | None:
    """Bytes this process's allocator may still take under its cap (set_per_process_memory_fraction:
    fraction of the card's total), less what it already holds; None without a cap."""
    return None if fraction >= 1 else max(0, int(fraction * total) - reserved)


def fits_on_device(data_bytes: int, free_bytes: int, budget_bytes: int | None) -> bool:
    """Whether a dataset of data_bytes should live on the GPU: under DATA_ON_DEVICE_SHARE of what the job
    may take, the card's free memory or, when it is capped (a job that stated resources.gpu_memory_gb),
    its own budget if smaller. A job held to 6 GB on an 80 GB card keeps a 10 GB dataset in host memory."""
    room = free_bytes if budget_bytes is None else min(free_bytes, budget_bytes)
    return data_bytes < DATA_ON_DEVICE_SHARE * room


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


def _oom_where(batch_size: int, evaluating: bool) -> str:
    if evaluating:  # the batch the job asked for is not the one that failed: say how they relate
        return (f"evaluating with batch_size {batch_size} (validation batches start at max(batch_size, 1024) and "
                f"halve down to train.batch_size)")
    return f"with batch_size {batch_size}"


class EvaluationOutOfMemory(torch.OutOfMemoryError):
    """Out of GPU memory evaluating, at the smallest evaluation batch (the training batch_size); the
    message says what to change."""


def format_oom(device_name: str, batch_size: int, allocated: int, reserved: int, total: int,
               evaluating: bool = False) -> str:
    """The message of a job that ran out of GPU memory, from numbers (so it is testable without a GPU)."""
    where = _oom_where(batch_size, evaluating)
    more = " or a larger resources.gpu_memory_gb" if evaluating else ""
    return (
        f"CUDA out of memory on {device_name} {where}: "
        f"{_gib(allocated)} allocated, {_gib(reserved)} reserved by PyTorch, {_gib(total)} total. "
        f"Try a smaller batch_size (e.g. {max(1, batch_size // 2)}), or precision 'bf16' or 'fp16' "
        f"to halve activation memory{more}."
    )


def oom_message(device: torch.device, batch_size: int, evaluating: bool = False) -> str:
    """format_oom() with the numbers read from torch.cuda at the time of failure."""
    if device.type != "cuda":
        return f"out of memory on {device} {_oom_where(batch_size, evaluating)}; try a smaller batch_size"
    return format_oom(
        f"{device} ({torch.cuda.get_device_name(device)})", batch_size,
        torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
        torch.cuda.get_device_properties(device).total_memory, evaluating,
    )
