"""Processes as the tests watch them, from /proc and the jobs' logs: alive or gone, a job's process ids,
resident memory."""
import os
import re
import time
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: it only waits for its parent to reap it. A process reaped between the kill and
    # the read makes the read fail with ESRCH (ProcessLookupError), not ENOENT: any OSError is a gone process.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone(pid: int) -> bool:
    return not alive(pid)


def all_gone(pids: list[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


def job_pids(service, job_id) -> list[int]:
    """The job processes a job's log names (one a run)."""
    with service.client() as c:
        return [int(p) for p in re.findall(r"job process pid (\d+)", c.get(f"/jobs/{job_id}/logs").text)]


def rank_pids(service, job_id) -> list[int]:
    """The rank processes a multi-device job's log names."""
    with service.client() as c:
        return [int(p) for p in re.findall(r"rank \d+ pid (\d+)", c.get(f"/jobs/{job_id}/logs").text)]


def _status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def rss(pid: int) -> int:
    """The process's resident memory now (VmRSS)."""
    return _status_bytes(pid, "VmRSS")


def peak_rss(pid: int) -> int:
    """The process's peak resident memory (VmHWM) since the last reset_peak()."""
    return _status_bytes(pid, "VmHWM")


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
