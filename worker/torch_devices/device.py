"""The job process's device: which it is, made current, set up before CUDA starts, and whether it failed.

The job process calls these first, before anything of the job touches the device (worker/runner.py).
"""
import os

import torch

from trainyard.app import device_names
from trainyard.worker.errors import DeviceFailure, JobError

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


def cuda_rng_state(device: torch.device) -> torch.Tensor | None:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_cuda_rng_state(device: torch.device, state: torch.Tensor | None) -> None:
    if device.type == "cuda" and state is not None:
        torch.cuda.set_rng_state(state, device)

