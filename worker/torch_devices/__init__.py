"""The torch side of devices, in the job process: resolve the device, apply the speed switches, read allocator stats.

Everything that touches torch.cuda lives here behind a device-type check, so the training loop never
calls torch.cuda itself and the CPU tests run the same code paths a GPU job does. Callers use the
names below (torch_devices.resolve, torch_devices.autocast...); each lives in one of:

    device      which device, made current, set up before CUDA starts; whether it failed
    switches    tf32, cuDNN autotuning, determinism, precision, channels_last
    step        torch.compile with its eager fallback, CPU threads for small steps, the warm-up batch
    gpu_memory  whether data fits on the card, allocator stats, out-of-memory messages
"""
from trainyard.worker.errors import DeviceFailure
from trainyard.worker.torch_devices.device import (
    CUBLAS_WORKSPACE_CONFIG,
    DEVICE_ERRORS,
    cuda_error,
    cuda_rng_state,
    is_device_failure,
    limit_memory_fraction,
    prepare_deterministic,
    resolve,
    set_cuda_rng_state,
    use_device,
)
from trainyard.worker.torch_devices.gpu_memory import (
    DATA_ON_DEVICE_SHARE,
    EvaluationOutOfMemory,
    data_fits_device,
    fits_on_device,
    format_oom,
    job_budget,
    memory_stats,
    oom_message,
    reset_peak_memory,
)
from trainyard.worker.torch_devices.step import (
    SMALL_STEP_FLOPS,
    compile_model,
    fit_cpu_threads,
    step_flops,
    warm_up_batch,
)
from trainyard.worker.torch_devices.switches import (
    BF16_MIN_CAPABILITY,
    autocast,
    choose_precision,
    configure,
    grad_scaler,
    resolve_precision,
    use_channels_last,
)

__all__ = [
    "BF16_MIN_CAPABILITY", "CUBLAS_WORKSPACE_CONFIG", "DATA_ON_DEVICE_SHARE", "DEVICE_ERRORS", "SMALL_STEP_FLOPS",
    "DeviceFailure", "EvaluationOutOfMemory", "autocast", "choose_precision", "compile_model", "configure",
    "cuda_rng_state", "data_fits_device", "fit_cpu_threads", "fits_on_device", "format_oom", "grad_scaler",
    "cuda_error", "is_device_failure", "job_budget", "limit_memory_fraction", "memory_stats", "oom_message",
    "prepare_deterministic", "reset_peak_memory", "resolve", "resolve_precision", "set_cuda_rng_state",
    "step_flops", "use_channels_last", "use_device", "warm_up_batch",
]
