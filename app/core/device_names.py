"""Device names, one vocabulary: what a job may ask for and what a worker serves, normalised once.

A job asks for `auto` (any worker), `cpu`, `cuda` (any GPU worker) or `cuda:N`. A worker serves
one concrete device, `cpu` or `cuda:N`, where N is torch's index (after CUDA_VISIBLE_DEVICES).
Torch-free: the API, the supervisor and the CLI all use it.
"""
import re

# Used with re.fullmatch here and as a pydantic `pattern` (whose `$` is the end of the text): a
# trailing newline never slips through, unlike Python's re.match with `$`.
PATTERN = r"^(auto|cpu|cuda|cuda:[0-9]{1,2})$"
JOB_DEVICES = ("auto", "cpu", "cuda", "cuda:N")


def valid(name: str) -> bool:
    return re.fullmatch(PATTERN, name) is not None


def cuda(index: int) -> str:
    return f"cuda:{index}"


def cuda_index(name: str) -> int | None:
    """N of `cuda:N` (0 for plain `cuda`); None for the CPU and `auto`."""
    if name == "cuda":
        return 0
    return int(name.partition(":")[2]) if name.startswith("cuda:") else None


def for_worker(name: str, cuda_count: int) -> str:
    """The concrete device a worker started with `--device name` serves: `auto` is the first GPU when
    the host has one, else the CPU; `cuda` is cuda:0. ValueError for a name outside the vocabulary."""
    if not valid(name):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {name!r}")
    if name == "auto":
        return cuda(0) if cuda_count > 0 else "cpu"
    index = cuda_index(name)
    return "cpu" if index is None else cuda(index)


def accepted_by(worker_device: str) -> list[str]:
    """The job device requests a worker serving `worker_device` may take."""
    if worker_device == "cpu":
        return ["auto", "cpu"]
    return ["auto", "cuda", worker_device]
