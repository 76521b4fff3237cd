"""Reading NVML, the driver's view of a host's GPUs: each card (or each MIG instance) with its UUID,
memory and utilisation, and the driver's version.

Nothing here initialises CUDA or imports torch: a CUDA context in the API server or the worker
supervisor would take GPU memory away from the jobs. NVML is initialised once per process.
"""
import os
import threading
import time
from collections.abc import Callable
from typing import Any

# What each GPU entry holds (gpu_entries), and what a worker's host reading reports of each.
GPU_FIELDS = ("name", "uuid", "compute_capability", "memory_total", "memory_used", "memory_free", "utilization_gpu",
              "mig_parent", "problem")

# A process without an NVIDIA driver tries NVML again at most this often (not at every heartbeat).
NVML_RETRY_S = 60.0
_nvml_state: dict[str, Any] = {"pid": None, "module": None, "failed_at": 0.0}
_nvml_lock = threading.Lock()


def _init_nvml() -> Any:
    """Load and initialise NVML; raises without an NVIDIA driver. Called once per process (_nvml)."""
    import pynvml
    pynvml.nvmlInit()
    return pynvml


def _nvml() -> Any:
    """pynvml, initialised once per process and never shut down (every heartbeat and every /devices
    request reads through it); None without a driver, tried again at most every NVML_RETRY_S. A forked
    child initialises its own: NVML's handles do not survive a fork."""
    with _nvml_lock:
        state = _nvml_state
        if state["pid"] == os.getpid():
            if state["module"] is not None or time.monotonic() - state["failed_at"] < NVML_RETRY_S:
                return state["module"]
        state.update(pid=os.getpid(), module=None, failed_at=0.0)
        try:
            state["module"] = _init_nvml()
        except Exception:
            state["failed_at"] = time.monotonic()
        return state["module"]


def nvml_devices() -> list[dict[str, Any]] | None:
    """One dict per GPU from NVML (per MIG instance on a card in MIG mode), or None when there is no
    NVIDIA driver. A GPU whose reading fails is listed with `problem`, the others as usual."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        count, driver = nv.nvmlDeviceGetCount(), _s(nv.nvmlSystemGetDriverVersion())
    except Exception:
        return None
    try:
        v = nv.nvmlSystemGetCudaDriverVersion_v2()  # 12080: the newest CUDA the driver supports is 12.8
        cuda_driver = f"{v // 1000}.{v % 1000 // 10}"
    except Exception:
        cuda_driver = None
    return gpu_entries(count, lambda i: _read_card(nv, i), driver, cuda_driver)


def _read_card(nv: Any, i: int) -> dict[str, Any]:
    """NVML's raw reading of card i and, in MIG mode, of each of its MIG instances (gpu_entries reads it)."""
    h = nv.nvmlDeviceGetHandleByIndex(i)
    mem = nv.nvmlDeviceGetMemoryInfo(h)
    major, minor = nv.nvmlDeviceGetCudaComputeCapability(h)
    try:
        util = nv.nvmlDeviceGetUtilizationRates(h).gpu
    except Exception:
        util = None
    card = {"nvml_index": i, "name": _s(nv.nvmlDeviceGetName(h)), "uuid": _s(nv.nvmlDeviceGetUUID(h)),
            "compute_capability": f"{major}.{minor}", "memory_total": mem.total, "memory_used": mem.used,
            "memory_free": mem.free, "utilization_gpu": util}
    try:
        mig_mode, _pending = nv.nvmlDeviceGetMigMode(h)
    except Exception:
        mig_mode = None
    if mig_mode == nv.NVML_DEVICE_MIG_ENABLE:
        card["mig"] = []
        for j in range(nv.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
            except nv.NVMLError_NotFound:  # an empty slot
                continue
            mm = nv.nvmlDeviceGetMemoryInfo(m)
            card["mig"].append({"mig_index": j, "name": _s(nv.nvmlDeviceGetName(m)),
                                "uuid": _s(nv.nvmlDeviceGetUUID(m)), "memory_total": mm.total,
                                "memory_used": mm.used, "memory_free": mm.free})
    return card


def gpu_entries(count: int, read: Callable[[int], dict], driver: str | None,
                cuda_driver: str | None = None) -> list[dict[str, Any]]:
    """The GPUs of a host from NVML's raw readings of its `count` cards (read(i): _read_card's dict).
    A card in MIG mode is its MIG instances, each with its own UUID and memory (CUDA runs on an
    instance, never on the card); a card whose reading fails is one entry naming the failure, and the
    others are read as usual. Pure: tests feed it recorded readings."""
    out = []
    for i in range(count):
        base = {"nvml_index": i, "driver_version": driver, "cuda_driver_version": cuda_driver}
        try:
            card = read(i)
        except Exception as exc:
            out.append({**{k: None for k in GPU_FIELDS}, **base, "problem": f"NVML could not read it: {exc}"})
            continue
        migs = card.pop("mig", None)
        if migs is None:
            out.append({**card, **base, "mig_parent": None, "problem": None})
        elif not migs:
            out.append({**card, **base, "mig_parent": None,
                        "problem": "MIG mode is on and the card has no MIG instance: CUDA cannot use it"})
        for m in migs or ():
            out.append({**base, **m, "compute_capability": card["compute_capability"], "utilization_gpu": None,
                        "mig_parent": card["uuid"], "problem": None})
    return out


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# -- one GPU's processes and free memory: a job's CUDA context being freed, and what placement sees ----------------

_handles: dict[tuple[int, str], Any] = {}  # (pid, UUID) -> NVML handle: a handle does not survive a fork


def _handle(nv: Any, uuid: str) -> Any:
    key = (os.getpid(), uuid)
    if key not in _handles:
        _handles[key] = nv.nvmlDeviceGetHandleByUUID(uuid)
    return _handles[key]


def compute_processes(uuid: str) -> list[tuple[int, int | None]] | None:
    """(pid, bytes it uses, None where NVML cannot say) of each compute process NVML lists on the GPU or MIG
    instance named by uuid; None without NVML or when that GPU cannot be read (nothing known to wait for).
    The pids are the host's: under a PID namespace of its own (a container without --pid=host) they are not
    this process's pids."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        return processes_of(nv, _handle(nv, uuid))
    except Exception:
        return None


def processes_of(nv: Any, handle: Any) -> list[tuple[int, int | None]]:
    """NVML's compute processes on a handle, through the newest of the calls this driver has (_v3 from R510)."""
    for name in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
                 "nvmlDeviceGetComputeRunningProcesses"):
        call = getattr(nv, name, None)
        if call is None:
            continue
        try:
            found = call(handle)
        except nv.NVMLError_FunctionNotFound:
            continue
        return [(int(p.pid), p.usedGpuMemory) for p in found]
    return []


def memory_free(uuid: str) -> int | None:
    """The bytes NVML says are free on the GPU or MIG instance named by uuid now (every process's memory,
    contexts still being freed included, is not); None without NVML or when it cannot be read."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        return int(nv.nvmlDeviceGetMemoryInfo(_handle(nv, uuid)).free)
    except Exception:
        return None
