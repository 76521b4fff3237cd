"""The /devices answer: every host's GPUs (keyed by UUID) and CPU, with the workers on each, assembled from
this (the API's) host's NVML reading and the workers' heartbeats, each carrying its own host's reading."""
import socket
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Engine

from trainyard.app.core import device_names
from trainyard.app.fleet import hardware
from trainyard.app.fleet import workers as workers_registry
from trainyard.app.fleet.gpu_order import visible_indices
from trainyard.app.fleet.nvml import GPU_FIELDS, nvml_devices


def snapshot(engine: Engine, stale_after_s: float, node: str | None = None) -> dict[str, Any]:
    """The /devices payload now: NVML readings plus the workers' last heartbeats."""
    workers, now = workers_registry.list_workers(engine)
    return build_payload(nvml_devices(), workers, now, hardware.torch_build_info(), hardware.cpu_info(),
                         stale_after_s, host=node or socket.gethostname())


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
    hosts: dict[str, dict] = {host: {"host": host, "driver_version": nvml[0].get("driver_version") if nvml else None,
                                     "cpu": cpu}}
    gpus = _gpus(nvml, workers, visible, host, hosts)
    cuda = sorted(({**g, "workers": []} for g in gpus.values()),
                  key=lambda g: (g["host"] != host, g["host"], g["index"] is None, g["index"] or 0))
    cpu_workers, other_workers = _place_workers(workers, cuda, host, lambda w: _worker_view(w, now, stale_after_s))
    for name in (*cpu_workers, *other_workers):
        hosts.setdefault(name, {"host": name, "driver_version": None, "cpu": None})
    grouped = [{**h, "cuda_devices": [g for g in cuda if g["host"] == name],
                "other_workers": other_workers.get(name, []),
                "cpu": {**(h["cpu"] or {}), "workers": cpu_workers.get(name, [])}}
               for name, h in sorted(hosts.items(), key=lambda kv: (kv[0] != host, kv[0]))]
    build = _reported_build(build, workers)
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


def _reported_build(build: dict, workers: list[dict]) -> dict:
    """Workers report the versions their job processes really see; prefer those over package files."""
    reported: dict = next((w["stats"]["build"] for w in workers if (w.get("stats") or {}).get("build")), {})
    return {**build, **{k: v for k, v in reported.items() if k.endswith("_version") and v is not None}}


def _gpus(nvml: list[dict], workers: list[dict], visible: list[int], host: str, hosts: dict[str, dict]) -> dict:
    """Every GPU by key (its UUID), from the workers' readings and this host's; each worker's host is
    added to `hosts`."""
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
    return gpus


def _worker_view(w: dict, now: float, stale_after_s: float) -> dict:
    age = max(0.0, now - w["last_heartbeat"])
    stats = w.get("stats") or {}
    return {"id": w["id"], "host": w["host"], "pid": w["pid"], "device": w["device"],
            "state": workers_registry.worker_state(w, now, stale_after_s),
            "job_id": w["job_id"], "torch": stats.get("torch"), "last_heartbeat_age_s": round(age, 3),
            "draining": bool(w.get("draining")), "unavailable": stats.get("unavailable")}


def _place_workers(workers: list[dict], cuda: list[dict], host: str,
                   view: Callable[[dict], dict]) -> tuple[dict, dict]:
    """Each worker's view on its GPU (added to that GPU's `workers`), and per host the CPU workers and
    the GPU workers whose GPU no reading lists (an unavailable one, say)."""
    by_uuid = {g["uuid"]: g for g in cuda}
    cpu_workers: dict[str, list] = {}
    other_workers: dict[str, list] = {}
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
    return cpu_workers, other_workers
