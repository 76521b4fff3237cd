"""Routes about the service itself: devices, workers, health."""
from fastapi import APIRouter, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from trainyard.app import admission, devices_payload, job_reads, metrics, spec
from trainyard.app import workers as workers_registry
from trainyard.app.api.deps import EngineDep, SettingsDep
from trainyard.app.api.routes.jobs import as_json
from trainyard.app.api.schemas import WorkerPublic, responses, ts
from trainyard.app.api.schemas_service import CatalogPublic, DevicesPublic, Health

router = APIRouter(tags=["system"])
health_router = APIRouter(tags=["system"])


@router.get("/devices", response_model=DevicesPublic, operation_id="list_devices")
async def get_devices(engine: EngineDep, settings: SettingsDep) -> Response:
    """CUDA devices (from NVML, never a CUDA context in this process), their workers' torch allocator
    stats (from heartbeats), and the CPU."""
    return as_json(await run_in_threadpool(devices_payload.snapshot, engine, settings.lease_s, settings.node))


@router.get("/metrics", response_class=Response, operation_id="prometheus_metrics",
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
def get_metrics(request: Request) -> Response:
    """Prometheus metrics (names prefixed trainyard_): jobs by state and kind, queue depth, job
    durations, workers alive, device memory, torch allocator memory, samples/s of running jobs."""
    return Response(metrics.render(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/catalog", response_model=CatalogPublic, operation_id="catalog")
def get_catalog(engine: EngineDep, settings: SettingsDep) -> Response:
    """The architectures, datasets and job fields a client may submit, with their limits, and the plugins
    installed on this server or on the live workers."""
    return as_json(spec.catalog(admission.plugin_catalog(engine, settings)))


@router.get("/workers", response_model=list[WorkerPublic], operation_id="list_workers")
def get_workers(engine: EngineDep, settings: SettingsDep, include_stopped: bool = False) -> list[WorkerPublic]:
    workers, now = workers_registry.list_workers(engine, include_stopped=include_stopped)
    return [_public(w, now, settings.lease_s) for w in workers]


WorkerId = Path(max_length=200, description="a worker's id, as GET /workers lists it")
WORKER_ERRORS = responses(not_found="no such worker", conflict="the worker has stopped")


@router.post("/workers/{worker_id}/drain", response_model=WorkerPublic, responses=WORKER_ERRORS,
             operation_id="drain_worker")
def drain_worker(engine: EngineDep, settings: SettingsDep, worker_id: str = WorkerId) -> WorkerPublic:
    """The worker finishes the job it runs (if any) and claims nothing more until undrained."""
    return _set_draining(engine, settings, worker_id, True)


@router.post("/workers/{worker_id}/undrain", response_model=WorkerPublic, responses=WORKER_ERRORS,
             operation_id="undrain_worker")
def undrain_worker(engine: EngineDep, settings: SettingsDep, worker_id: str = WorkerId) -> WorkerPublic:
    """The worker claims jobs again."""
    return _set_draining(engine, settings, worker_id, False)


def _set_draining(engine, settings, worker_id: str, draining: bool) -> WorkerPublic:
    w = workers_registry.set_draining(engine, worker_id, draining)
    _, now = workers_registry.list_workers(engine)
    return _public(w, now, settings.lease_s)


def _public(w: dict, now: float, lease_s: float) -> WorkerPublic:
    return WorkerPublic(id=w["id"], host=w["host"], pid=w["pid"], device=w["device"],
                        state=workers_registry.worker_state(w, now, lease_s), job_id=w["job_id"],
                        started_at=ts(w["started_at"]), last_heartbeat=ts(w["last_heartbeat"]),
                        last_heartbeat_age_s=round(max(0.0, now - w["last_heartbeat"]), 3),
                        torch=(w["stats"] or {}).get("torch"), draining=bool(w.get("draining")),
                        unavailable=(w["stats"] or {}).get("unavailable"))


@health_router.get("/healthz", response_model=Health, operation_id="healthz")
def healthz(engine: EngineDep) -> Health:
    """The server answers and its database does (one trivial query: a health check must stay cheap
    whatever the jobs hold)."""
    job_reads.ping(engine)
    return Health(status="ok")
