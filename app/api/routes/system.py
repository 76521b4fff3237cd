"""Routes about the service itself: devices, workers, health, /metrics.

The fleet is everyone's to see, but a worker's job is shown only to those who may see that job (its project's
members, admins): to anyone else the worker is busy with a job of id null. Where a worker's process lives (its
host's address for other hosts, its process id) is for admins, who run the fleet: a member follows their jobs by
a worker's id, host, device and state. Draining is for admins."""
from collections.abc import Iterable, Iterator
from typing import Any

from fastapi import APIRouter, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import select

from trainyard.app import spec
from trainyard.app.accounts import Principal, audit
from trainyard.app.api.deps import AdminDep, EngineDep, SettingsDep, WhoDep, client_address
from trainyard.app.api.routes.jobs import as_json
from trainyard.app.api.schemas import WorkerPublic, responses, ts
from trainyard.app.api.schemas_admin import FORBIDDEN
from trainyard.app.api.schemas_service import CatalogPublic, DevicesPublic, Health
from trainyard.app.db import jobs, read
from trainyard.app.fleet import devices_payload
from trainyard.app.fleet import workers as workers_registry
from trainyard.app.jobs import admission
from trainyard.app.observe import prometheus
from trainyard.app.records import job_reads, visibility

router = APIRouter(tags=["system"])
health_router = APIRouter(tags=["system"])


@router.get("/devices", response_model=DevicesPublic, operation_id="list_devices")
async def get_devices(engine: EngineDep, settings: SettingsDep, who: WhoDep) -> Response:
    """CUDA devices (from NVML, never a CUDA context in this process), their workers' torch allocator
    stats (from heartbeats), and the CPU. A worker's job_id is null unless the token may see that job."""
    def snapshot() -> dict[str, Any]:
        payload = devices_payload.snapshot(engine, settings.lease_s, settings.node)
        views = list(_payload_workers(payload))
        _hide_jobs(engine, who, views)
        if not who.admin:
            for w in views:
                w["pid"] = None
        return payload
    return as_json(await run_in_threadpool(snapshot))


@router.get("/metrics", response_class=Response, operation_id="prometheus_metrics",
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
def get_metrics(request: Request, engine: EngineDep, settings: SettingsDep, who: WhoDep) -> Response:
    """Prometheus metrics (names prefixed trainyard_): jobs by state and kind, queue depth, job
    durations, workers alive, device memory, torch allocator memory, samples/s of running jobs.

    An admin's token gets all of them. Any other token gets the series computed from its project's rows (jobs
    by kind and state, the queue's depth and age, running jobs' samples/s, sweeps and their trials) and the
    fleet's worker and device gauges (which name no job), but not the counters, the job-duration histogram or
    the store's gauges: those are kept for the whole service, not per project."""
    reg = request.app.state.metrics_registry if who.admin else prometheus.registry(engine, settings.lease_s,
                                                                                   settings.node, who)
    return Response(prometheus.render(reg), media_type=CONTENT_TYPE_LATEST)


@router.get("/catalog", response_model=CatalogPublic, operation_id="catalog")
def get_catalog(engine: EngineDep, settings: SettingsDep) -> Response:
    """The architectures, datasets and job fields a client may submit, with their limits, and the plugins
    installed on this server or on the live workers."""
    return as_json(spec.catalog(admission.plugin_catalog(engine, settings)))


@router.get("/workers", response_model=list[WorkerPublic], operation_id="list_workers")
def get_workers(engine: EngineDep, settings: SettingsDep, who: WhoDep,
                include_stopped: bool = False) -> list[WorkerPublic]:
    """Every worker (stopped ones too with include_stopped). job_id is null unless the token may see that job;
    addr and pid are null unless the token is an admin's."""
    workers, now = workers_registry.list_workers(engine, include_stopped=include_stopped)
    _hide_jobs(engine, who, workers)
    return [_public(w, now, settings.lease_s, who.admin) for w in workers]


WorkerId = Path(max_length=200, description="a worker's id, as GET /workers lists it")
WORKER_ERRORS = {**responses(not_found="no such worker", conflict="the worker has stopped"), **FORBIDDEN}


@router.post("/workers/{worker_id}/drain", response_model=WorkerPublic, responses=WORKER_ERRORS,
             operation_id="drain_worker")
def drain_worker(request: Request, engine: EngineDep, settings: SettingsDep, who: AdminDep,
                 worker_id: str = WorkerId) -> WorkerPublic:
    """The worker finishes the job it runs (if any) and claims nothing more until undrained. Admins only."""
    return _set_draining(request, engine, settings, who, worker_id, True)


@router.post("/workers/{worker_id}/undrain", response_model=WorkerPublic, responses=WORKER_ERRORS,
             operation_id="undrain_worker")
def undrain_worker(request: Request, engine: EngineDep, settings: SettingsDep, who: AdminDep,
                   worker_id: str = WorkerId) -> WorkerPublic:
    """The worker claims jobs again. Admins only."""
    return _set_draining(request, engine, settings, who, worker_id, False)


def _set_draining(request: Request, engine, settings, who: Principal, worker_id: str,
                  draining: bool) -> WorkerPublic:
    w = workers_registry.set_draining(engine, worker_id, draining)
    audit.record(engine, who, "drain" if draining else "undrain", f"worker {worker_id}", client_address(request))
    _, now = workers_registry.list_workers(engine)
    return _public(w, now, settings.lease_s, who.admin)


def _hide_jobs(engine, who: Principal, workers: Iterable[dict]) -> None:
    """Each worker's job_id set to None where `who` may not see that job (another project's)."""
    workers = list(workers)
    scope = visibility.job_scope(who)
    ids = {w["job_id"] for w in workers if w.get("job_id") is not None}
    if scope is None or not ids:
        return
    with read(engine) as conn:
        seen = set(conn.execute(select(jobs.c.id).where(jobs.c.id.in_(ids), scope)).scalars())
    for w in workers:
        if w.get("job_id") not in seen:
            w["job_id"] = None


def _payload_workers(payload: dict[str, Any]) -> Iterator[dict]:
    """Every worker view of a /devices payload, wherever it is listed (hosts' devices and the flat views)."""
    for host in payload["hosts"]:
        for gpu in host["cuda_devices"]:
            yield from gpu["workers"]
        yield from host["cpu"]["workers"]
        yield from host["other_workers"]
    for gpu in payload["cuda_devices"]:
        yield from gpu["workers"]
    yield from payload["cpu"]["workers"]
    yield from payload["other_workers"]


def _public(w: dict, now: float, lease_s: float, admin: bool) -> WorkerPublic:
    return WorkerPublic(id=w["id"], host=w["host"], addr=(w["stats"] or {}).get("addr") if admin else None,
                        pid=w["pid"] if admin else None,
                        device=w["device"],
                        state=workers_registry.worker_state(w, now, lease_s), job_id=w["job_id"],
                        started_at=ts(w["started_at"]), last_heartbeat=ts(w["last_heartbeat"]),
                        last_heartbeat_age_s=round(max(0.0, now - w["last_heartbeat"]), 3),
                        torch=(w["stats"] or {}).get("torch"), draining=bool(w.get("draining")),
                        unavailable=(w["stats"] or {}).get("unavailable"))


# What /healthz answers, serialised once (Health's JSON).
HEALTHY = b'{"status":"ok"}'


@health_router.get("/healthz", response_model=Health, operation_id="healthz")
async def healthz(request: Request) -> Response:
    """The server answers and its database does (one trivial query: a health check must stay cheap
    whatever the jobs hold). Through the loop reader, as the job reads: inline on SQLite, no dependencies to
    solve, no thread-pool hop there, no response model to validate (a probe pays this every few seconds)."""
    await request.app.state.reader.run(job_reads.ping)
    return Response(HEALTHY, media_type="application/json")
