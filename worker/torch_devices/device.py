"""The job process's device: which it is, made current, set up before CUDA starts, and whether it failed.

The job process calls these first, before anything of the job touches the device (worker/runner.py).
"""
import os
import re

import torch

from trainyard.app.core import device_names
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
    """A worker's device name (app/core/device_names.py) -> torch.device, checking that the device exists."""
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


# The CUDA runtime's errors (cudaError_t) that say the device or its driver failed, not the job's code, each by
# its name and by the runtime's own description of it (cudaGetErrorString). torch raises a CUDA error as
# "CUDA error: <description>", with "Search for `<name>'" beside it where it knows the name (recorded on an H200:
# tests/fixtures/gpu/cuda_failures_h200.json). The ones a job's own code causes (a device-side assert, an illegal
# address, a bad device ordinal, a launch failure) are not here: they are the job's.
DEVICE_ERRORS = {
    "cudaErrorInitializationError": "initialization error",
    "cudaErrorInsufficientDriver": "CUDA driver version is insufficient for CUDA runtime version",
    "cudaErrorDevicesUnavailable": "CUDA-capable device(s) is/are busy or unavailable",
    "cudaErrorNoDevice": "no CUDA-capable device is detected",
    "cudaErrorECCUncorrectable": "uncorrectable ECC error encountered",
    "cudaErrorNvlinkUncorrectable": "uncorrectable NVLink error detected during the execution",
    "cudaErrorHardwareStackError": "hardware stack error",
    "cudaErrorLaunchTimeout": "the launch timed out and was terminated",
    "cudaErrorSystemNotReady": "system not yet initialized",
    "cudaErrorSystemDriverMismatch": "system has unsupported display driver / cuda driver combination",
    "cudaErrorUnknown": "unknown error",  # what a GPU that fell off the bus (XID 79) answers every call with
}
# torch's own words when CUDA cannot start at all in the job process (no driver, or one that fails to load).
NO_DRIVER = ("Found no NVIDIA driver on your system", "CUDA driver initialization failed")
_NAME = re.compile(r"Search for `(cudaError\w+)'")
_DESCRIPTION = re.compile(r"CUDA error: ([^\n]*)")
_BY_DESCRIPTION = {text: name for name, text in DEVICE_ERRORS.items()}


def cuda_error(message: str) -> str | None:
    """The cudaError_t name a torch error message carries: its own "Search for" name, else the one whose
    description it quotes (of DEVICE_ERRORS'); None for neither."""
    named = _NAME.search(message)
    if named:
        return named.group(1)
    quoted = _DESCRIPTION.search(message)
    return _BY_DESCRIPTION.get(quoted.group(1).strip().rstrip(".")) if quoted else None


def is_device_failure(exc: BaseException) -> bool:
    """Whether an exception of a running job is its device failing (an `infrastructure` failure): a DeviceFailure,
    or a CUDA error (torch.AcceleratorError, a RuntimeError in older torch) whose cudaError_t is a device's or
    driver's, or torch finding no working driver. Out of memory is never one (torch.OutOfMemoryError: `oom`)."""
    if isinstance(exc, DeviceFailure):
        return True
    if not isinstance(exc, RuntimeError) or isinstance(exc, torch.OutOfMemoryError):
        return False
    message = str(exc)
    return cuda_error(message) in DEVICE_ERRORS or any(words in message for words in NO_DRIVER)


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

