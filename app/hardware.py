"""Hardware as the API sees it: NVML readings, the torch build, the CPU, and worker heartbeats -> /devices.

Nothing here initialises CUDA or imports torch: a CUDA context in the API server or the worker
supervisor would take GPU memory away from the jobs. NVML reads the driver's view; the torch
allocator's view comes from worker heartbeats.
"""
import importlib.metadata
import importlib.util
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from trainyard.app import device_names
from trainyard.app import workers as workers_registry


def nvml_devices() -> list[dict[str, Any]] | None:
    """One dict per physical GPU from NVML, or None when there is no NVIDIA driver."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        out = []
        driver = _s(pynvml.nvmlSystemGetDriverVersion())
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            try:
                util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
            except Exception:
                util = None
            out.append({"nvml_index": i, "name": _s(pynvml.nvmlDeviceGetName(h)), "uuid": _s(pynvml.nvmlDeviceGetUUID(h)),
                        "compute_capability": f"{major}.{minor}", "memory_total": mem.total,
                        "memory_used": mem.used, "memory_free": mem.free, "utilization_gpu": util,
                        "driver_version": driver})
        return out
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def visible_indices(physical_count: int, env: str | None = None) -> list[int]:
    """Map torch's cuda:N to NVML's physical index, honouring CUDA_VISIBLE_DEVICES (integer form)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    if env is None:
        return list(range(physical_count))
    out = []
    for part in env.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) >= physical_count:
            break  # CUDA stops at the first invalid entry
        out.append(int(part))
    return out


def visible_cuda_count() -> int:
    nv = nvml_devices()
    return len(visible_indices(len(nv))) if nv else 0


def worker_device_info(device: str) -> dict[str, Any] | None:
    """The NVML view of the device a worker is bound to (name, total memory), for its registration."""
    if not device.startswith("cuda"):
        return None
    nv = nvml_devices() or []
    idx = visible_indices(len(nv))
    n = device_names.cuda_index(device)
    return nv[idx[n]] if n < len(idx) else None


@lru_cache
def torch_build_info() -> dict[str, Any]:
    """torch, CUDA and cuDNN versions of the installed build, read from package files, not by importing torch.
    Cached: scanning the installed distributions takes tens of milliseconds."""
    info: dict[str, Any] = {"torch_version": None, "cuda_version": None, "cudnn_version": None}
    try:
        info["torch_version"] = importlib.metadata.version("torch")
        spec = importlib.util.find_spec("torch")
        text = (Path(spec.submodule_search_locations[0]) / "version.py").read_text()
        m = re.search(r"^cuda\s*(?::\s*\S+)?\s*=\s*'([^']+)'", text, re.M)
        info["cuda_version"] = m.group(1) if m else None
    except Exception:
        pass
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("nvidia-cudnn"):
            info["cudnn_version"] = dist.version
            break
    return info


def cpu_info() -> dict[str, Any]:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"cores": os.cpu_count(), "memory_total": total, "memory_available": available}


def build_payload(nvml: list[dict] | None, workers: list[dict], now: float, build: dict,
                  cpu: dict, stale_after_s: float, visible: list[int] | None = None) -> dict[str, Any]:
    """Assemble the /devices answer from raw readings. Pure: tests feed it recorded numbers."""
    nvml = nvml or []
    visible = visible_indices(len(nvml)) if visible is None else visible
    # Workers report the versions their job processes really see; prefer those over package files.
    reported = next((w["stats"]["build"] for w in workers if (w.get("stats") or {}).get("build")), {})
    build = {**build, **{k: v for k, v in reported.items() if k.endswith("_version") and v is not None}}

    def view(w: dict) -> dict:
        age = max(0.0, now - w["last_heartbeat"])
        stats = w.get("stats") or {}
        return {"id": w["id"], "host": w["host"], "pid": w["pid"], "device": w["device"],
                "state": workers_registry.worker_state(w, now, stale_after_s),
                "job_id": w["job_id"], "torch": stats.get("torch"), "last_heartbeat_age_s": round(age, 3)}

    cuda = []
    for torch_index, phys in enumerate(visible):
        d = nvml[phys]
        name = device_names.cuda(torch_index)
        cuda.append({
            "index": torch_index, "name": d["name"], "uuid": d.get("uuid"),
            "compute_capability": d["compute_capability"], "memory_total": d["memory_total"],
            "memory_used": d["memory_used"], "memory_free": d["memory_free"],
            "utilization_gpu": d.get("utilization_gpu"),
            "workers": [view(w) for w in workers if w["device"] == name],
        })
    return {
        "cuda_available": bool(cuda),
        "driver_version": nvml[0].get("driver_version") if nvml else None,
        **{k: build.get(k) for k in ("torch_version", "cuda_version", "cudnn_version")},
        "cuda_devices": cuda,
        "cpu": {**cpu, "workers": [view(w) for w in workers if w["device"] == "cpu"]},
    }


def snapshot(engine, stale_after_s: float) -> dict[str, Any]:
    """The /devices payload now: NVML readings plus the workers' last heartbeats."""
    workers, now = workers_registry.list_workers(engine)
    return build_payload(nvml_devices(), workers, now, torch_build_info(), cpu_info(), stale_after_s)
