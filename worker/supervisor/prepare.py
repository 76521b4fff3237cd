"""Draw up a claimed job's plan on this host: its directories, the stored files it needs here first,
and its share of the host (torch threads, memory budget, GPU memory fraction). Torch-free.

The worker (worker/supervisor/main.py) calls plan_job() once per claimed job; the job process gets only the
JobPlan it returns (worker/supervisor/plan.py).
"""
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.app.core.layout import ARTIFACT_FILES, UPLOAD_DATA_FILE, UPLOAD_META_FILE
from trainyard.app.core.settings import Settings
from trainyard.app.fleet import gpu_order, host_cpu, host_memory, placement, spread
from trainyard.app.records import Job, job_reads
from trainyard.app.spec import uploads_named
from trainyard.worker.supervisor import memory
from trainyard.worker.supervisor.plan import JobPlan


def plan_job(job: Job, settings: Settings, device: str, db: Callable[..., Any], here: dict[str, list],
             gpu_memory_fraction: float | None) -> JobPlan:
    """The plan of a job this worker claimed. db: the worker's queue call (Worker.db); here: this host's
    live workers, all and CPU ones (CPU jobs share the cores, every job the memory)."""
    layout = settings.layout
    run_dir, stem = layout.run_dir(job.id, job.claim), layout.checkpoint_stem(job.id, job.claim)
    run_dir.mkdir(parents=True, exist_ok=True)
    stem.parent.mkdir(parents=True, exist_ok=True)
    model_dir = model_spec = model_job = None
    field = "model_job" if job.kind == "predict" else "init_from"  # the job whose artifact this one uses
    if job.spec.get(field) is not None:
        model_job = db(job_reads.get_job, job.spec[field])
        if not model_job.artifact_path:
            raise FileNotFoundError(f"{field} {model_job.id} has no artifact")
        model_dir = layout.resolve(model_job.artifact_path)
        model_spec = model_job.spec if model_job.kind == "train" and job.kind == "predict" else None
    return JobPlan(
        job=job, device=device, data_dir=settings.data_dir, run_dir=run_dir, checkpoint_stem=stem,
        storage_url=settings.storage_url, fetch=fetch_keys(settings, job, model_job),
        ranks=tuple(r["device"] for r in job.ranks or ()),
        rank_uuids=tuple(r.get("key") if gpu_order.is_device_uuid(r.get("key")) else None for r in job.ranks or ()),
        master=spread.master(job.ranks), node_addr=settings.node_addr or "",
        local_ranks=spread.ranks_on(job.ranks, settings.node) if (job.hosts or 1) > 1 else (),
        resume_from=layout.resolve(job.checkpoint_path) if job.checkpoint_path else None,
        threads=job_threads(device, here),
        memory_budget=memory.budget(settings.job_memory_bytes, settings.job_memory_share,
                                    host_memory.total(), len(here["all"])),
        gpu_memory_fraction=gpu_memory_fraction, model_dir=model_dir, model_spec=model_spec,
        scratch_dir=scratch(settings, job))


def job_threads(device: str, here: dict[str, list]) -> int:
    """A job's torch threads: the cores this worker may use (its affinity, its cgroup's CPU quota where lower:
    app/fleet/host_cpu.py), shared among the host's workers. A CPU job shares them with the CPU workers' jobs; a
    CUDA job's host side (data loading, CPU ops, the optimizer where it runs there) with every live worker's:
    left to torch, each of eight GPU workers' jobs takes every core."""
    sharing = here["cpu"] if device == "cpu" else here["all"]
    return max(1, host_cpu.cores() // max(1, len(sharing)))


def scratch(settings: Settings, job: Job) -> Path | None:
    """A run job's ctx.data_dir: a directory of its own for this run, not the service's data directory
    (the database is in it). What earlier runs of the job left (a worker killed) goes first."""
    if job.kind != "run":
        return None
    shutil.rmtree(settings.layout.scratch(job.id), ignore_errors=True)
    path = settings.layout.scratch(job.id, job.claim)
    path.mkdir(parents=True)
    return path


def fetch_keys(settings: Settings, job: Job, model_job: Job | None) -> tuple[str, ...]:
    """The stored files the job process needs on this host's disk before it starts (from a bucket:
    another host may have written them): the checkpoint it resumes from, the model a predict job
    uses or a train job starts from, the uploads its spec names."""
    layout = settings.layout
    keys = [job.checkpoint_path] if job.checkpoint_path else []
    if model_job is not None:
        keys += [f"{model_job.artifact_path}/{ARTIFACT_FILES[k]}" for k in ("meta", "safetensors")]
    keys += [f"{layout.rel(layout.upload(u))}/{name}"
             for u in sorted(uploads_named(job.spec)) for name in (UPLOAD_META_FILE, UPLOAD_DATA_FILE)]
    return tuple(keys)


def gpu_fraction(job: Job, settings: Settings, device: str, slot: placement.Slot, stats: dict) -> float | None:
    """A job that stated its GPU memory is held to it (torch's per-process fraction), so that its
    growth fails it with `oom`, not the job beside it on the same GPU. stats: the worker's heartbeat's."""
    if job.need_gpu_memory and slot.budget and device.startswith("cuda"):
        total = next((g["memory_total"] for g in stats["host"]["gpus"] if g["uuid"] == slot.key), slot.budget)
        return min(1.0, job.need_gpu_memory / total)
    return settings.job_gpu_memory_fraction
