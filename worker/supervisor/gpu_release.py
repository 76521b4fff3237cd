"""Waiting for the GPU memory of a job that ended: its worker claims nothing more until NVML no longer lists
the job's processes on its GPUs. Torch-free.

A process's exit does not free its GPU memory at once: the driver tears its CUDA context down after the
process is gone (a second or more for a context holding tens of GB), and NVML lists the pid until then.
A job started meanwhile on the same card finds less memory than placement counted for it and may fail
`oom` through no fault of its own. So after a job process on a GPU ends (it finished, failed, or was
killed, preempted or cancelled) its supervisor waits, up to TRAINYARD_GPU_RELEASE_WAIT_S, for NVML to
list none of the job's pids on the job's GPUs of this host, and says in the job's log how long it took.
Past the limit it goes on with a warning naming what NVML still shows. Without NVML there is nothing to
wait for. The pids NVML lists are the host's: a worker in a PID namespace of its own (a container without
`--pid=host`) never sees its job's pid there, and this wait ends at once; placement's reading of the
GPU's free memory at each claim (app/fleet/placement.py fits_now) still holds back a job that would not fit.
"""
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from trainyard.app.fleet import nvml
from trainyard.app.fleet.gpu_order import is_device_uuid
from trainyard.worker.supervisor.plan import JobPlan

log = logging.getLogger("trainyard.worker")

# How often NVML is read while a context is being freed: its teardown takes from tens of ms to seconds.
PAUSE_S = 0.05

# NVML's compute processes of each GPU (by UUID): (pid, bytes used, None where NVML cannot say); None: no NVML.
Reading = dict[str, list[tuple[int, int | None]]]


@dataclass(frozen=True)
class Release:
    """How a wait for a job's GPU memory ended."""
    freed: bool                               # NVML lists none of the job's pids on its GPUs any more
    waited_s: float
    held: list[tuple[str, int, int | None]]   # (GPU, pid, bytes) of the job's that NVML still listed at the end

    def describe(self) -> str:
        return ", ".join(f"pid {pid} on {gpu}: {'?' if used is None else f'{used / 2**30:.2f} GiB'}"
                         for gpu, pid, used in self.held)


def job_gpus(plan: JobPlan) -> list[str]:
    """The GPUs (NVML UUIDs) of this host that the job's processes ran on: its ranks here, or the one it was
    claimed on. None of them on a CPU job, or where the worker knew no UUID (no NVML)."""
    if not plan.device.startswith("cuda"):
        return []
    if plan.rank_uuids:
        here = plan.local_ranks or range(len(plan.rank_uuids))
        keys: Iterable[str | None] = [plan.rank_uuids[r] for r in here if r < len(plan.rank_uuids)]
    else:
        keys = [plan.job.gpu_key]
    return sorted({k for k in keys if k is not None and is_device_uuid(k)})


def read_nvml(gpus: list[str]) -> Reading | None:
    """NVML's compute processes on each of gpus now; None without NVML (or when none of them can be read)."""
    found = {gpu: nvml.compute_processes(gpu) for gpu in gpus}
    readable = {gpu: procs for gpu, procs in found.items() if procs is not None}
    return readable or None


def wait_for_release(pids: set[int], read: Callable[[], Reading | None], limit_s: float,
                     tick: Callable[[], None] = lambda: None, pause_s: float = PAUSE_S) -> Release | None:
    """Wait until read() lists none of pids on any GPU, at most limit_s seconds, calling tick() (the worker's
    heartbeat) between reads. None when there is nothing to read (no NVML)."""
    start = time.monotonic()
    while True:
        reading = read()
        if reading is None:
            return None
        held = [(gpu, pid, used) for gpu, procs in sorted(reading.items()) for pid, used in procs if pid in pids]
        waited = time.monotonic() - start
        if not held or waited >= limit_s:
            return Release(not held, waited, held)
        tick()
        time.sleep(min(pause_s, max(0.0, limit_s - waited)))
