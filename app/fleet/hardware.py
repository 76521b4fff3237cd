"""Hardware as a worker sees it: the torch build, the CPU, the host reading a worker reports at every
heartbeat, and why a worker cannot use its device. NVML's readings are app/fleet/nvml.py's, which GPU a
device number is app/fleet/gpu_order.py's, and the /devices answer app/fleet/devices_payload.py's.

Nothing here initialises CUDA or imports torch: a CUDA context in the API server or the worker
supervisor would take GPU memory away from the jobs. NVML reads the driver's view; the torch
allocator's view comes from worker heartbeats.
"""
import importlib.metadata
import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from trainyard.app.core import device_names
from trainyard.app.fleet import host_cpu, host_memory, nvml
from trainyard.app.fleet.gpu_order import bare_uuid, torch_order, visible_indices
from trainyard.app.fleet.nvml import GPU_FIELDS


@lru_cache
def torch_build_info() -> dict[str, Any]:
    """torch, CUDA and cuDNN versions of the installed build, read from package files, not by importing torch.
    Cached: scanning the installed distributions takes tens of milliseconds."""
    info: dict[str, Any] = {"torch_version": None, "cuda_version": None, "cudnn_version": None}
    try:
        info["torch_version"] = importlib.metadata.version("torch")
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.submodule_search_locations:
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
    """The cores and the memory this process's cgroup may use (a container's, not its host's)."""
    total, available = host_memory.reading()
    return {"cores": host_cpu.cores(), "memory_total": total, "memory_available": available}


def host_reading(device: str, torch_uuids: list[str | None] | None = None) -> dict[str, Any]:
    """What a worker reports of its own host at every heartbeat: the host's GPUs from NVML (with the
    torch index each has for this worker), which of them is its own, and the CPU. torch_uuids (what
    the warm-up child read of torch's devices) match torch's numbering to NVML's by UUID; without them
    CUDA_VISIBLE_DEVICES is parsed. The API merges readings by GPU UUID, so any number of hosts can
    share one database."""
    nv = nvml.nvml_devices() or []
    order = torch_order(nv, torch_uuids) if torch_uuids is not None else visible_indices(nv)
    gpus = [{**{k: d.get(k) for k in GPU_FIELDS}, "nvml_index": d.get("nvml_index"),
             "index": order.index(p) if p in order else None} for p, d in enumerate(nv)]
    own = None
    n = device_names.cuda_index(device)
    if n is not None:
        p = order[n] if n < len(order) else None
        torch_uuid = torch_uuids[n] if torch_uuids and n < len(torch_uuids) else None
        if p is not None:
            own = nv[p]["uuid"]
        elif not nv and torch_uuid:
            own = f"GPU-{bare_uuid(torch_uuid)}"  # no NVML here (no utility driver part): torch's word
    return {"gpus": gpus, "device_uuid": own, "cpu": cpu_info(),
            "driver_version": nv[0].get("driver_version") if nv else None,
            "cuda_driver_version": nv[0].get("cuda_driver_version") if nv else None}


# The oldest driver branch each CUDA major version runs on (CUDA's minor version compatibility), and a
# torch wheel index for that line: what to tell the operator of a host whose driver is older than the
# torch build needs.
DRIVER_FOR_CUDA = {13: "R580", 12: "R525", 11: "R450"}
TORCH_INDEX_FOR_CUDA = {12: "https://download.pytorch.org/whl/cu128", 11: "https://download.pytorch.org/whl/cu118"}


def _version(v: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in (v or "").split(".")[:2])
    except ValueError:
        return ()


def device_problem(device: str, seen: dict, reading: dict, visible_env: str | None = None) -> str | None:
    """Why a worker cannot use `device`, naming the cause and the fix; None when it can. From what its
    warm-up child saw of torch (`seen`: fork_server.build_info, the only process that touched CUDA)
    and what NVML sees of the host (`reading`: host_reading). Pure: tests feed it recorded readings."""
    n = device_names.cuda_index(device)
    if n is None:
        return None
    if not seen:
        return (f"{device}: the warm-up process reported nothing (torch failed to import, or CUDA's "
                "initialisation hung): see the worker's log and run `nvidia-smi` on the host")
    torch_v, built = seen.get("torch_version"), seen.get("cuda_version")
    driver, supports = reading.get("driver_version"), reading.get("cuda_driver_version")
    listed = [g for g in reading.get("gpus") or [] if g.get("uuid")]
    cvd = f" under CUDA_VISIBLE_DEVICES={visible_env!r}" if visible_env is not None else ""
    said = f" (torch: {seen['cuda_error']})" if seen.get("cuda_error") else ""
    if not built:
        return (f"{device}: torch {torch_v} is a CPU-only build: install a CUDA build of torch (the image "
                "Dockerfile.gpu builds, or pip install torch from https://download.pytorch.org/whl/cuXXX), "
                "or start a CPU worker (--device cpu)")
    if not seen.get("cuda_available"):
        if driver is None:
            return (f"{device}: CUDA is not available: no NVIDIA driver is visible to this process (NVML "
                    f"cannot be loaded){said}. Run the worker on a host with an NVIDIA GPU and driver; in a "
                    "container, give it the GPUs (docker run --gpus all, or compose's GPU reservation, with "
                    "the NVIDIA Container Toolkit); or start a CPU worker (--device cpu)")
        if supports and _version(supports) < _version(built):
            major = _version(supports)[0]
            index = TORCH_INDEX_FOR_CUDA.get(major)
            instead = (f", or install torch built for CUDA {major}.x: TORCH_INDEX_URL={index} (docker build "
                       f"-f Dockerfile.gpu --build-arg TORCH_INDEX_URL={index} ..., or pip install --index-url "
                       f"{index} torch=={(torch_v or '').split('+')[0]} torchvision)") if index else ""
            need = DRIVER_FOR_CUDA.get(_version(built)[0])
            return (f"{device}: CUDA is not available: the NVIDIA driver {driver} supports CUDA up to {supports}, "
                    f"and torch {torch_v} is built for CUDA {built}"
                    f"{f' (driver {need} or newer)' if need else ''}{said}. Upgrade the driver{instead}")
        if not visible_indices(reading.get("gpus") or [], visible_env):
            return (f"{device}: CUDA_VISIBLE_DEVICES={visible_env!r} names none of this host's GPUs (NVML lists "
                    f"{', '.join(g['uuid'] for g in listed) or 'none'}): give it their numbers, GPU-<uuid> or "
                    "MIG-<uuid>")
        return (f"{device}: CUDA is not available to torch {torch_v} (CUDA {built}){said}, though NVML lists "
                f"{len(listed)} GPU(s) with driver {driver}: check `nvidia-smi`, and in a container that it "
                "has the driver's compute part (NVIDIA_DRIVER_CAPABILITIES=compute,utility)")
    count = seen.get("cuda_device_count") or 0
    if n >= count:
        names = f"cuda:0..cuda:{count - 1}" if count else "none"
        return (f"{device} does not exist: torch sees {count} CUDA device(s){cvd} ({names}): start the worker "
                "with one of those, or change CUDA_VISIBLE_DEVICES")
    devices = seen.get("cuda_devices") or []
    if n >= len(devices):
        return f"{device}: torch could not read the device{said}: check `nvidia-smi`"
    uuid = devices[n].get("uuid")
    if listed and uuid and torch_order(listed, [uuid]) == [None]:
        return (f"{device}: torch and NVML disagree: torch's {device} is GPU {uuid}, which NVML does not list "
                f"({', '.join(g['uuid'] for g in listed)}): check that the driver and its NVML library match "
                "(`nvidia-smi` works) and that NVIDIA_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES name the same GPUs")
    return None
