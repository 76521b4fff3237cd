"""Hardware as the API sees it: NVML readings, the torch build, the CPU, and worker heartbeats -> /devices.

Nothing here initialises CUDA or imports torch: a CUDA context in the API server or the worker
supervisor would take GPU memory away from the jobs. NVML reads the driver's view; the torch
allocator's view comes from worker heartbeats.
"""
import importlib.metadata
import importlib.util
import os
import re
import socket
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


GPU_FIELDS = ("name", "uuid", "compute_capability", "memory_total", "memory_used", "memory_free", "utilization_gpu")


def host_reading(device: str) -> dict[str, Any]:
    """What a worker reports of its own host at every heartbeat: the host's GPUs from NVML (with the
    torch index each has under this worker's CUDA_VISIBLE_DEVICES), which of them is its own, and the
    CPU. The API merges these by GPU UUID, so any number of hosts can share one database."""
    nv = nvml_devices() or []
    visible = visible_indices(len(nv))
    gpus = [{**{k: d.get(k) for k in GPU_FIELDS}, "index": visible.index(i) if i in visible else None}
            for i, d in enumerate(nv)]
    own = None
    if device.startswith("cuda"):
        n = device_names.cuda_index(device)
        own = nv[visible[n]]["uuid"] if n < len(visible) else None
    return {"gpus": gpus, "device_uuid": own, "cpu": cpu_info(),
            "driver_version": nv[0].get("driver_version") if nv else None}


def build_payload(nvml: list[dict] | None, workers: list[dict], now: float, build: dict,
                  cpu: dict, stale_after_s: float, visible: list[int] | None = None,
                  host: str = "localhost") -> dict[str, Any]:
    """Assemble the /devices answer from raw readings: this (the API's) host's NVML reading and CPU,
    and each worker's heartbeat with its own host's reading. Pure: tests feed it recorded numbers.

    GPUs are keyed by UUID and grouped by the host they are on. A GPU seen both by this host and by a
    worker (the API and a worker container on one machine) is one GPU, on the worker's host, with
    this host's fresher numbers."""
    nvml = nvml or []
    visible = visible_indices(len(nvml)) if visible is None else visible
    # Workers report the versions their job processes really see; prefer those over package files.
    reported = next((w["stats"]["build"] for w in workers if (w.get("stats") or {}).get("build")), {})
    build = {**build, **{k: v for k, v in reported.items() if k.endswith("_version") and v is not None}}

    hosts: dict[str, dict] = {host: {"host": host, "driver_version": nvml[0].get("driver_version") if nvml else None,
                                     "cpu": cpu}}
    gpus: dict[str, dict] = {}
    for w in sorted(workers, key=lambda w: w["last_heartbeat"]):  # the freshest reading wins
        reading = (w.get("stats") or {}).get("host")
        if not reading or w["state"] == "stopped":
            continue
        hosts[w["host"]] = {"host": w["host"], "driver_version": reading.get("driver_version"), "cpu": reading["cpu"]}
        for g in reading.get("gpus") or []:
            gpus[g["uuid"]] = {**g, "host": w["host"]}
    for phys, d in enumerate(nvml):
        seen = gpus.get(d.get("uuid") or f"{host}/{phys}")
        index = visible.index(phys) if phys in visible else None
        if seen is None and index is None:
            continue  # hidden from this host's CUDA_VISIBLE_DEVICES and no worker reports it
        gpus[d.get("uuid") or f"{host}/{phys}"] = {**{k: d.get(k) for k in GPU_FIELDS},
                                                   "index": seen["index"] if seen else index,
                                                   "host": seen["host"] if seen else host}

    def view(w: dict) -> dict:
        age = max(0.0, now - w["last_heartbeat"])
        stats = w.get("stats") or {}
        return {"id": w["id"], "host": w["host"], "pid": w["pid"], "device": w["device"],
                "state": workers_registry.worker_state(w, now, stale_after_s),
                "job_id": w["job_id"], "torch": stats.get("torch"), "last_heartbeat_age_s": round(age, 3),
                "draining": bool(w.get("draining"))}

    cuda = sorted(({**g, "workers": []} for g in gpus.values()),
                  key=lambda g: (g["host"] != host, g["host"], g["index"] is None, g["index"] or 0))
    by_uuid = {g["uuid"]: g for g in cuda}
    cpu_workers: dict[str, list] = {}
    for w in workers:
        if w["device"] == "cpu":
            cpu_workers.setdefault(w["host"], []).append(view(w))
            continue
        reading = (w.get("stats") or {}).get("host")
        if reading:
            gpu = by_uuid.get(reading.get("device_uuid"))
        else:  # a worker from before host readings: by name, among this host's GPUs
            n = device_names.cuda_index(w["device"])
            gpu = next((g for g in cuda if g["host"] == host and g["index"] == n), None)
        if gpu is not None:
            gpu["workers"].append(view(w))
    for name in cpu_workers:
        hosts.setdefault(name, {"host": name, "driver_version": None, "cpu": None})
    grouped = [{**h, "cuda_devices": [g for g in cuda if g["host"] == name],
                "cpu": {**(h["cpu"] or {}), "workers": cpu_workers.get(name, [])}}
               for name, h in sorted(hosts.items(), key=lambda kv: (kv[0] != host, kv[0]))]
    return {
        "cuda_available": bool(cuda),
        "driver_version": next((h["driver_version"] for h in grouped if h["driver_version"]), None),
        **{k: build.get(k) for k in ("torch_version", "cuda_version", "cudnn_version")},
        "hosts": grouped,
        # Flat views, each GPU and worker naming its host: every GPU; this host's CPU with every CPU worker.
        "cuda_devices": cuda,
        "cpu": {**cpu, "workers": [w for h in grouped for w in h["cpu"]["workers"]]},
    }


def snapshot(engine, stale_after_s: float, node: str | None = None) -> dict[str, Any]:
    """The /devices payload now: NVML readings plus the workers' last heartbeats."""
    workers, now = workers_registry.list_workers(engine)
    return build_payload(nvml_devices(), workers, now, torch_build_info(), cpu_info(), stale_after_s,
                         host=node or socket.gethostname())
