"""A job's GPU memory: whether its dataset fits on the card, the allocator's stats, and what an
out-of-memory error tells the user to change (the numbers formatted apart from torch, for testing).
"""
import torch

# A dataset is copied to the GPU whole only when it takes less than this share of the free memory,
# leaving the rest for activations, gradients and optimizer state.
DATA_ON_DEVICE_SHARE = 0.5


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
