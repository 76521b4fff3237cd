"""Routes about the service itself: devices, workers, health."""
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from app import devices, metrics, queue, spec
from app.api.deps import EngineDep, SettingsDep
from app.api.schemas import WorkerPublic, ts

router = APIRouter(tags=["system"])
health_router = APIRouter(tags=["system"])


@router.get("/devices")
async def get_devices(engine: EngineDep, settings: SettingsDep) -> dict:
    """CUDA devices (from NVML, never a CUDA context in this process), their workers' torch allocator
    stats (from heartbeats), and the CPU."""
    return await run_in_threadpool(devices.snapshot, engine, settings.lease_s)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
def get_metrics(request: Request) -> Response:
    """Prometheus metrics (names prefixed trainyard_): jobs by state and kind, queue depth, job
    durations, workers alive, device memory, torch allocator memory, samples/s of running jobs."""
    return Response(metrics.render(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/catalog")
def get_catalog() -> dict:
    """The architectures, datasets and job fields a client may submit, with their limits."""
    return spec.catalog()


@router.get("/workers", response_model=list[WorkerPublic])
def get_workers(engine: EngineDep, settings: SettingsDep, include_stopped: bool = False) -> list[WorkerPublic]:
    workers, now = queue.list_workers(engine, include_stopped=include_stopped)
    out = []
    for w in workers:
        age = max(0.0, now - w["last_heartbeat"])
        out.append(WorkerPublic(id=w["id"], host=w["host"], pid=w["pid"], device=w["device"],
                                state=queue.worker_state(w, now, settings.lease_s),
                                job_id=w["job_id"], started_at=ts(w["started_at"]),
                                last_heartbeat=ts(w["last_heartbeat"]), last_heartbeat_age_s=round(age, 3),
                                torch=(w["stats"] or {}).get("torch")))
    return out


@health_router.get("/healthz")
def healthz(engine: EngineDep) -> dict:
    queue.list_jobs(engine, limit=1)
    return {"status": "ok"}
