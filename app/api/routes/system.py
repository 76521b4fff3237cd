"""Routes about the service itself: devices, workers, health."""
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from trainyard.app import admission, hardware, metrics, queue, spec
from trainyard.app import workers as workers_registry
from trainyard.app.api.deps import EngineDep, SettingsDep
from trainyard.app.api.schemas import WorkerPublic, ts

router = APIRouter(tags=["system"])
health_router = APIRouter(tags=["system"])


@router.get("/devices")
async def get_devices(engine: EngineDep, settings: SettingsDep) -> dict:
    """CUDA devices (from NVML, never a CUDA context in this process), their workers' torch allocator
    stats (from heartbeats), and the CPU."""
    return await run_in_threadpool(hardware.snapshot, engine, settings.lease_s)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
def get_metrics(request: Request) -> Response:
    """Prometheus metrics (names prefixed trainyard_): jobs by state and kind, queue depth, job
    durations, workers alive, device memory, torch allocator memory, samples/s of running jobs."""
    return Response(metrics.render(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/catalog")
def get_catalog(engine: EngineDep, settings: SettingsDep) -> dict:
    """The architectures, datasets and job fields a client may submit, with their limits, and the plugins
    installed on this server or on the live workers."""
    return spec.catalog(admission.plugin_catalog(engine, settings))


@router.get("/workers", response_model=list[WorkerPublic])
def get_workers(engine: EngineDep, settings: SettingsDep, include_stopped: bool = False) -> list[WorkerPublic]:
    workers, now = workers_registry.list_workers(engine, include_stopped=include_stopped)
    out = []
    for w in workers:
        age = max(0.0, now - w["last_heartbeat"])
        out.append(WorkerPublic(id=w["id"], host=w["host"], pid=w["pid"], device=w["device"],
                                state=workers_registry.worker_state(w, now, settings.lease_s),
                                job_id=w["job_id"], started_at=ts(w["started_at"]),
                                last_heartbeat=ts(w["last_heartbeat"]), last_heartbeat_age_s=round(age, 3),
                                torch=(w["stats"] or {}).get("torch")))
    return out


@health_router.get("/healthz")
def healthz(engine: EngineDep) -> dict:
    """The server answers and its database does (one trivial query: a health check must stay cheap
    whatever the jobs hold)."""
    queue.ping(engine)
    return {"status": "ok"}
