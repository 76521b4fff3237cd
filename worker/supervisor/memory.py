"""Host memory of job processes: each job's budget, how a process's memory is read, and the limit a
CPU job process puts on itself. Torch-free: the supervisor and the job process both use it.

Two guards, because no one guard covers every job:
- a CPU job process limits its own data segment (RLIMIT_DATA) to what it had at start plus its
  budget, so an allocation past the budget fails inside the job (torch: "can't allocate memory";
  numpy: MemoryError) and the job reports `oom` with what it asked for;
- the supervisor reads every job process's resident memory as often as it checks the job's fence,
  and stops one that grew past its budget (CUDA jobs, where RLIMIT_DATA is not set: the CUDA
  driver's host mappings are not for us to limit), failing it `oom` with the peak it saw.
A job process the kernel kills anyway (SIGKILL while its worker lives) is reported `oom` too.
"""
import resource
from dataclasses import dataclass
from pathlib import Path

MIN_BUDGET = 1 << 30


def _status(pid: int | str = "self") -> dict[str, int]:
    """Vm* and Rss* lines of /proc/<pid>/status in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.startswith(("Vm", "Rss")) and value.strip().endswith("kB"):
            out[key] = int(value.split()[0]) * 1024
    return out


def resident(pid: int) -> int | None:
    """A process's resident memory in bytes, None once it is gone."""
    try:
        return _status(pid).get("VmRSS")
    except (FileNotFoundError, ProcessLookupError):
        return None


def budget(job_memory_bytes: int | None, share: float, host_bytes: int, live_workers_here: int) -> int:
    """Host memory one job process may use: the setting, or its share of the host split among the host's
    live workers (each may run a job at once); never below MIN_BUDGET."""
    if job_memory_bytes:
        return job_memory_bytes
    return max(MIN_BUDGET, int(share * host_bytes / max(1, live_workers_here)))


def limit_data_segment(budget_bytes: int) -> int:
    """In the job process: let its data segment grow by budget_bytes from now, no more. Returns the limit."""
    limit = _status().get("VmData", 0) + budget_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    return limit


def is_allocation_failure(exc: BaseException) -> bool:
    """A host allocation refused (by the budget's limit, or by the host itself)."""
    return isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def budget_message(budget_bytes: int, used: int | None, detail: str = "") -> str:
    """The error of a job that went past its host-memory budget, from numbers."""
    seen = f"; it used {gib(used)}" if used is not None else ""
    return (f"out of host memory: the job's budget is {gib(budget_bytes)} (TRAINYARD_JOB_MEMORY_BYTES or "
            f"TRAINYARD_JOB_MEMORY_SHARE){seen}{detail}. Use a smaller model, batch_size or dataset")


@dataclass
class Watch:
    """The supervisor's view of one job process's resident memory."""
    pid: int
    budget: int
    start: int = 0
    peak: int = 0

    def __post_init__(self) -> None:
        self.start = resident(self.pid) or 0
        self.peak = self.start

    def over(self) -> bool:
        """Read the process's memory now; true once it has grown past its budget."""
        now = resident(self.pid)
        if now is not None:
            self.peak = max(self.peak, now)
        return now is not None and now - self.start > self.budget

    @property
    def grown(self) -> int:
        return self.peak - self.start
