"""Why a queued job waits: the class and the words a client reads in `waiting_for`, weighed against the live
workers as they are (app/fleet/placement.py holds the SQL a claim uses; this is what the API and the gauges tell
people), for one job, a list's page (read once for the page) and the jobs just submitted.
"""
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection, Engine

from trainyard.app.core import device_names
from trainyard.app.core.settings import Settings
from trainyard.app.core.states import WORKER_UNAVAILABLE as UNAVAILABLE
from trainyard.app.core.states import JobState
from trainyard.app.db import db_now, read, workers
from trainyard.app.fleet import dependencies, fair_share
from trainyard.app.fleet import workers as registry
from trainyard.app.records import Job


class Waiting(StrEnum):
    """What a queued job waits for, as a class (the reason label of trainyard_queue_depth,
    app/observe/prometheus.py)."""
    TURN = "turn"                        # nothing: some live worker can take it, in its turn, when it fits
    NO_WORKER = "no_worker"
    UNAVAILABLE = "device_unavailable"   # only workers that cannot use their device serve its device
    NO_DEVICE = "no_device_worker"       # no live worker serves its device
    DRAINING = "draining"
    DEVICES = "devices"                  # more devices than one host's live workers have
    PLUGIN = "plugin"
    GPU_MEMORY = "gpu_memory"
    DEPENDENCY = "dependency"            # jobs it waits for ("after", a model job) have not succeeded yet
    SLURM = "slurm"                      # an allocation of Slurm's (runs_on: slurm): Slurm decides when it starts


def spread_short(cands: list[dict[str, Any]], devices: int, hosts: int) -> str | None:
    """Why live, undrained workers cannot hold a job's `devices` spread over `hosts` hosts, or None if they can:
    devices / hosts of one kind on each host, and for hosts > 1 every host's workers reachable at an address."""
    per_host: dict[tuple[str, bool], int] = {}
    for w in cands:
        if hosts == 1 or (w.get("stats") or {}).get("addr"):
            group = (w["host"], w["device"] == "cpu")
            per_host[group] = per_host.get(group, 0) + 1
    need = devices // hosts
    if hosts == 1:
        most, (host, _) = max(((n, g) for g, n in per_host.items()), default=(0, ("no host", False)))
        return None if most >= devices else (
            f"needs {devices} devices of one host; the most live, undrained workers of one kind on one host is "
            f"{most} ({host}); set hosts to spread the job over several")
    for cpu in (True, False):
        full = sorted(h for (h, c), n in per_host.items() if c == cpu and n >= need)
        if len(full) >= hosts:
            return None
    best = max((sorted(h for (h, c), n in per_host.items() if c == cpu and n >= need) for cpu in (True, False)),
               key=len)
    return (f"needs {hosts} hosts with {need} device(s) of one kind each, whose workers set TRAINYARD_NODE_ADDR; "
            f"{len(best)} such host(s) have live, undrained workers ({', '.join(best) or 'none'})")


def why_waiting(job: Job, live_workers: list[dict[str, Any]]) -> str | None:
    """Why a queued job cannot start on any live worker, ever, as things stand (a worker that joins
    may change that); None when some live worker could take it and it is only waiting its turn."""
    found = waiting(job, live_workers)
    return None if found is None else found[1]


def waiting(job: Job, live_workers: list[dict[str, Any]]) -> tuple[Waiting, str] | None:
    """why_waiting's answer and its class. Workers that cannot use their device (state unavailable) take
    nothing; when only they serve the job's device, their reason is the job's."""
    broken = [w for w in live_workers if w.get("state") == UNAVAILABLE
              and job.device_req in device_names.accepted_by(w["device"])]
    live_workers = [w for w in live_workers if w.get("state") != UNAVAILABLE]
    if not live_workers and not broken:
        return Waiting.NO_WORKER, "no worker is running"
    cands = [w for w in live_workers if job.device_req in device_names.accepted_by(w["device"])]
    if not cands:
        if broken:
            w = broken[0]
            more = f" (and {len(broken) - 1} more unavailable)" if len(broken) > 1 else ""
            return Waiting.UNAVAILABLE, (f"no live worker can use a device for {job.device_req}: worker {w['id']} "
                                         f"on {w['host']} is unavailable{more}: "
                                         f"{(w.get('stats') or {}).get('unavailable') or 'no reason given'}")
        return Waiting.NO_DEVICE, f"no live worker serves device {job.device_req}"
    cands = [w for w in cands if not w.get("draining")]
    if not cands:
        return Waiting.DRAINING, f"every live worker for device {job.device_req} is draining"
    devices, hosts = job.devices or 1, job.hosts or 1
    if devices > 1:
        found = spread_short(cands, devices, hosts)
        if found is not None:
            return Waiting.DEVICES, found
    for kind, need in (("models", job.need_model), ("datasets", job.need_dataset),
                       ("entrypoints", job.need_entrypoint)):
        if need is not None:
            cands = [w for w in cands if need in ((w.get("stats") or {}).get("plugins") or {}).get(kind, [])]
            if not cands:
                return Waiting.PLUGIN, f"no live worker for device {job.device_req} has the {kind[:-1]} plugin {need!r}"
    if job.need_gpu_memory is not None:
        slots = [(((w.get("stats") or {}).get("slot") or {}), w) for w in cands]
        # What a job may state there: the budget less the headroom its process costs beyond it.
        offers = [(s["budget"] - (s.get("headroom") or 0), s.get("headroom") or 0, w)
                  for s, w in slots if s.get("budget") is not None]
        asked = f"needs {job.need_gpu_memory / 1e9:.1f} GB of GPU memory"
        if not offers:
            return Waiting.GPU_MEMORY, (f"{asked}; no live worker for device {job.device_req} offers GPU memory "
                                        "(GPU workers do)")
        most, headroom, w = max(offers, key=lambda o: o[0])
        if most < job.need_gpu_memory:
            beside = f", after {headroom / 1e9:.1f} GB of headroom for its CUDA context" if headroom else ""
            return Waiting.GPU_MEMORY, (f"{asked}; the most a live worker offers is {most / 1e9:.1f} GB{beside} "
                                        f"({w['host']} {w['device']})")
        held = held_by_nvml(job.need_gpu_memory, [(s, w) for s, w in slots if s.get("budget") is not None
                                                  and s["budget"] - (s.get("headroom") or 0) >= job.need_gpu_memory])
        if held:
            return Waiting.GPU_MEMORY, f"{asked}{held}"
    return None


def held_by_nvml(need: int, offering: list[tuple[dict, dict[str, Any]]]) -> str | None:
    """Why a job whose statement fits the budgets of these GPUs (each a worker's slot and the worker) still
    cannot start on one, as the rest of waiting()'s reason: none of them runs a job of ours, and NVML saw too
    little free on each (another program's memory, or a context still being freed). None when one may take
    it: it shows enough free, its free memory was not read, or some runs a job of ours (it waits its turn)."""
    if not offering or any(w.get("state") == "busy" for _s, w in offering):
        return None
    short = [(s["free"], s.get("headroom") or 0, w) for s, w in offering
             if s.get("free") is not None and s["free"] < need + (s.get("headroom") or 0)]
    if len(short) < len(offering):
        return None
    free, headroom, w = max(short, key=lambda o: o[0])
    context = f" and {headroom / 1e9:.1f} GB for its CUDA context" if headroom else ""
    return (f"{context}; NVML shows {free / 1e9:.1f} GB free on the GPU with the most ({w['host']} {w['device']}), "
            "which runs no job of this service: another program's memory, or a CUDA context still being freed")


def of_jobs(engine: Engine, settings: Settings, found: list[Job]) -> dict[int, str | None]:
    """For each queued job among these, why no live worker can take it (on_page's, on a connection of its own;
    none when no job is queued)."""
    if not any(j.state == JobState.QUEUED for j in found):
        return {}
    with read(engine) as conn:
        return on_page(conn, settings, found)


def on_page(conn: Connection, settings: Settings, found: list[Job]) -> dict[int, str | None]:
    """For each queued job among these (a list page), why no live worker can take it: what it waits on, else
    why_waiting, else its project's limits. Read once for the page, and only when a job is queued: the
    workers with the database's clock, the dependencies of all its queued jobs, the projects' limits (none when no
    queued job has a project). why_waiting's answer depends on a job's needs only: worked out once per need."""
    queued = [j for j in found if j.state == JobState.QUEUED]
    if not queued:
        return {}
    listed = [dict(r._mapping) for r in conn.execute(_WORKERS)]
    now = max((w.pop("db_now") for w in listed), default=0.0)
    live = registry.still_placing(listed, now, settings.lease_s)
    unmet = dependencies.unmet_on(conn, [j.id for j in queued])
    limited = fair_share.at_limit(conn, queued)
    by_need: dict[tuple, str | None] = {}
    out: dict[int, str | None] = {}
    for j in queued:
        if j.runs_on == "slurm" and j.id not in unmet:  # Slurm, not the live workers, decides when it starts
            out[j.id] = in_slurm(j)
            continue
        # Every field of the job waiting() reads: jobs alike in these wait for the same reason.
        need = (j.device_req, j.devices, j.hosts, j.need_model, j.need_dataset, j.need_entrypoint, j.need_gpu_memory)
        if j.id not in unmet and need not in by_need:
            by_need[need] = why_waiting(j, live)
        out[j.id] = dependencies.waiting_for(unmet[j.id]) if j.id in unmet else by_need[need] or limited.get(j.id)
    return out


def in_slurm(job: Job) -> str:
    """Why a queued job that runs on Slurm has not started: where its allocation is, as the agent last saw it
    (app/clusters/agent.py), with Slurm's reason while Slurm's queue holds it ("waiting in Slurm's queue:
    Resources")."""
    got = job.slurm or {}
    if not got.get("id"):
        return "waiting for the Slurm agent to ask for an allocation (trainyard slurm-agent)"
    if got.get("state") == "PENDING":
        return f"waiting in Slurm's queue: {got.get('reason') or 'None'} (Slurm job {got['id']}, partition " \
               f"{got.get('partition') or '?'})"
    return f"Slurm job {got['id']} is {got.get('state') or '?'} on {got.get('nodes') or '?'}: its workers are starting"


# registry.list_workers' read (the workers not stopped, oldest first), with the database's clock on each row.
_WORKERS = select(workers, db_now().label("db_now")).where(workers.c.state != "stopped").order_by(
    workers.c.started_at)


def at_submit(engine: Engine, named: list[Job]) -> dict[int, str]:
    """What jobs just submitted, that name others (dependencies.names_any), wait on by their own spec: one indexed
    read, none when none names any. POST /jobs answers it; the fleet's part of waiting_for (no worker for the
    device, a project's limits) is GET's, which reads the workers and the running jobs."""
    return {job_id: dependencies.waiting_for(deps) for job_id, deps in dependencies.unmet(
        engine, [j.id for j in named]).items()}
