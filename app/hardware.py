"""Hardware as the API sees it: NVML readings, the torch build, the CPU, and worker heartbeats -> /devices;
which GPU a worker's torch device is (by UUID) and why a worker cannot use its device.

Nothing here initialises CUDA or imports torch: a CUDA context in the API server or the worker
supervisor would take GPU memory away from the jobs. NVML reads the driver's view; the torch
allocator's view comes from worker heartbeats.
"""
import importlib.metadata
import importlib.util
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from trainyard.app import device_names
from trainyard.app import workers as workers_registry

# A process without an NVIDIA driver tries NVML again at most this often (not at every heartbeat).
NVML_RETRY_S = 60.0
_nvml_state: dict[str, Any] = {"pid": None, "module": None, "failed_at": 0.0}
_nvml_lock = threading.Lock()


def _init_nvml():
    """Load and initialise NVML; raises without an NVIDIA driver. Called once per process (_nvml)."""
    import pynvml
    pynvml.nvmlInit()
    return pynvml


def _nvml():
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


def _read_card(nv, i: int) -> dict[str, Any]:
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


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def bare_uuid(uuid: str | None) -> str | None:
    """A GPU's UUID without NVML's `GPU-`/`MIG-` prefix, as torch's device properties give it."""
    if uuid is None:
        return None
    u = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        u = u.removeprefix(prefix)
    return u


def _strtoul(s: str) -> int:
    """The number an entry of CUDA_VISIBLE_DEVICES starts with (`1gpu` is 1), -1 for none."""
    m = re.match(r"[+-]?\d+", s)
    return int(m.group()) if m else -1


def visible_indices(gpus: int | list[dict], env: str | None = None) -> list[int]:
    """Map CUDA's device numbers (torch's cuda:N) to positions in NVML's list of GPUs (nvml_devices(), or a
    count of whole cards), honouring CUDA_VISIBLE_DEVICES as CUDA and torch parse it: integers (cards
    in PCI bus order, the order CUDA_DEVICE_ORDER=PCI_BUS_ID gives them), `GPU-<uuid>` or a unique
    prefix of one, `MIG-<uuid>`. The first entry's form decides the list's; parsing stops at the first
    entry that names no device, and a device named twice empties the list."""
    if isinstance(gpus, int):
        gpus = [{"nvml_index": i, "uuid": None, "mig_parent": None} for i in range(gpus)]
    env = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    if env is None:
        return list(range(len(gpus)))
    entries = [e.strip() for e in env.split(",")]
    out: list[int] = []
    form = "GPU-" if env.startswith("GPU-") else "MIG-" if env.startswith("MIG-") else None
    for entry in entries:
        if form is None:
            n = _strtoul(entry)
            found = next((p for p, g in enumerate(gpus) if g.get("nvml_index") == n), None) if n >= 0 else None
        elif not entry.startswith(form):
            found = None
        else:
            mig = form == "MIG-"
            matches = [p for p, g in enumerate(gpus) if (g.get("uuid") or "").startswith(entry)
                       and bool(g.get("mig_parent")) == mig]
            found = matches[0] if len(matches) == 1 else None  # an ambiguous prefix names no device
        if found is None:
            break
        if found in out:
            return []
        out.append(found)
    return out


def is_device_uuid(key: str | None) -> bool:
    """A GPU's or MIG instance's UUID as NVML writes it (what CUDA_VISIBLE_DEVICES accepts)."""
    return isinstance(key, str) and key.startswith(("GPU-", "MIG-"))


def torch_order(gpus: list[dict], torch_uuids: list[str | None]) -> list[int | None]:
    """Positions in NVML's list of the GPUs torch numbers cuda:0, cuda:1 ..., matched by UUID (what the
    worker's warm-up child read of each: torch.cuda.get_device_properties(i).uuid); None for a device
    NVML does not list. By UUID, not by index: the two may count cards in different orders."""
    by_uuid = {bare_uuid(g.get("uuid")): p for p, g in enumerate(gpus) if g.get("uuid")}
    return [by_uuid.get(bare_uuid(u)) if u else None for u in torch_uuids]


def visible_cuda_count() -> int:
    nv = nvml_devices()
    return len(visible_indices(nv)) if nv else 0


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


GPU_FIELDS = ("name", "uuid", "compute_capability", "memory_total", "memory_used", "memory_free", "utilization_gpu",
              "mig_parent", "problem")


def host_reading(device: str, torch_uuids: list[str | None] | None = None) -> dict[str, Any]:
    """What a worker reports of its own host at every heartbeat: the host's GPUs from NVML (with the
    torch index each has for this worker), which of them is its own, and the CPU. torch_uuids (what
    the warm-up child read of torch's devices) match torch's numbering to NVML's by UUID; without them
    CUDA_VISIBLE_DEVICES is parsed. The API merges readings by GPU UUID, so any number of hosts can
    share one database."""
    nv = nvml_devices() or []
    order = torch_order(nv, torch_uuids) if torch_uuids is not None else visible_indices(nv)
    gpus = [{**{k: d.get(k) for k in GPU_FIELDS}, "nvml_index": d.get("nvml_index"),
             "index": order.index(p) if p in order else None} for p, d in enumerate(nv)]
    own = None
    if device.startswith("cuda"):
        n = device_names.cuda_index(device)
        p = order[n] if n < len(order) else None
        if p is not None:
            own = nv[p]["uuid"]
        elif not nv and torch_uuids and n < len(torch_uuids) and torch_uuids[n]:
            own = "GPU-" + bare_uuid(torch_uuids[n])  # no NVML here (no utility driver part): torch's word
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
    warm-up child saw of torch (`seen`: runner_entry.build_info, the only process that touched CUDA)
    and what NVML sees of the host (`reading`: host_reading). Pure: tests feed it recorded readings."""
    if not device.startswith("cuda"):
        return None
    n = device_names.cuda_index(device)
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


def build_payload(nvml: list[dict] | None, workers: list[dict], now: float, build: dict,
                  cpu: dict, stale_after_s: float, visible: list[int] | None = None,
                  host: str = "localhost") -> dict[str, Any]:
    """Assemble the /devices answer from raw readings: this (the API's) host's NVML reading and CPU,
    and each worker's heartbeat with its own host's reading. Pure: tests feed it recorded numbers.

    GPUs are keyed by UUID and grouped by the host they are on. A GPU seen both by this host and by a
    worker (the API and a worker container on one machine) is one GPU, on the worker's host, with
    this host's fresher numbers."""
    nvml = nvml or []
    visible = visible_indices(nvml) if visible is None else visible
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
            # An unreadable GPU has no UUID: keyed by its host and NVML index, so each stays one entry.
            gpus[g["uuid"] or f"{w['host']}/nvml{g.get('nvml_index')}"] = {**g, "host": w["host"]}
    for phys, d in enumerate(nvml):
        key = d.get("uuid") or f"{host}/nvml{d.get('nvml_index', phys)}"
        seen = gpus.get(key)
        index = visible.index(phys) if phys in visible else None
        if seen is None and index is None:
            continue  # hidden from this host's CUDA_VISIBLE_DEVICES and no worker reports it
        gpus[key] = {**{k: d.get(k) for k in GPU_FIELDS}, "index": seen["index"] if seen else index,
                     "host": seen["host"] if seen else host}

    def view(w: dict) -> dict:
        age = max(0.0, now - w["last_heartbeat"])
        stats = w.get("stats") or {}
        return {"id": w["id"], "host": w["host"], "pid": w["pid"], "device": w["device"],
                "state": workers_registry.worker_state(w, now, stale_after_s),
                "job_id": w["job_id"], "torch": stats.get("torch"), "last_heartbeat_age_s": round(age, 3),
                "draining": bool(w.get("draining")), "unavailable": stats.get("unavailable")}

    cuda = sorted(({**g, "workers": []} for g in gpus.values()),
                  key=lambda g: (g["host"] != host, g["host"], g["index"] is None, g["index"] or 0))
    by_uuid = {g["uuid"]: g for g in cuda}
    cpu_workers: dict[str, list] = {}
    other_workers: dict[str, list] = {}  # GPU workers whose GPU no reading lists (an unavailable one, say)
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
        else:
            other_workers.setdefault(w["host"], []).append(view(w))
    for name in (*cpu_workers, *other_workers):
        hosts.setdefault(name, {"host": name, "driver_version": None, "cpu": None})
    grouped = [{**h, "cuda_devices": [g for g in cuda if g["host"] == name],
                "other_workers": other_workers.get(name, []),
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
        # GPU workers on no listed GPU: unavailable ones (each with its reason), or on a host without NVML.
        "other_workers": [w for h in grouped for w in h["other_workers"]],
    }


def snapshot(engine, stale_after_s: float, node: str | None = None) -> dict[str, Any]:
    """The /devices payload now: NVML readings plus the workers' last heartbeats."""
    workers, now = workers_registry.list_workers(engine)
    return build_payload(nvml_devices(), workers, now, torch_build_info(), cpu_info(), stale_after_s,
                         host=node or socket.gethostname())
