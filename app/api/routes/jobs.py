"""Routes for jobs: submit, list, read, cancel, retry, metrics, events, artifact, result, logs."""
import asyncio
import json
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Body, Header, HTTPException, Path as PathParam, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel

from app import queue
from app.api.deps import EngineDep, SettingsDep
from app.api.schemas import JobPublic, JobsPublic, MetricPublic
from app.spec import (JOB_KINDS, JOB_STATES, MAX_ID, PREDICT_DATA_EXAMPLE, PREDICT_INPUTS_EXAMPLE, TERMINAL_STATES,
                      TRAIN_EXAMPLE, JobSpec)

router = APIRouter(prefix="/jobs", tags=["jobs"])
# Bounded so that no id reaches the database as an integer it cannot store.
JobId = Annotated[int, PathParam(ge=1, le=MAX_ID)]
EVENTS_POLL_S = 0.25

EXAMPLES = {
    "train": {"summary": "Train an MLP on Iris", "value": TRAIN_EXAMPLE},
    "predict_inputs": {"summary": "Predict classes for rows of features", "value": PREDICT_INPUTS_EXAMPLE},
    "predict_data": {"summary": "Evaluate on the validation split", "value": PREDICT_DATA_EXAMPLE},
}


@router.post("", status_code=201, response_model=JobPublic)
async def submit_job(spec: Annotated[JobSpec, Body(openapi_examples=EXAMPLES)], engine: EngineDep,
                     idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> Response:
    job, created = await run_in_threadpool(_submit, engine, spec, idempotency_key)
    return as_json(JobPublic.from_row(job), 201 if created else 200)


def _submit(engine, spec, idempotency_key):
    if spec.kind == "predict":
        queue.check_predict(engine, spec)
    return queue.enqueue(engine, spec, idempotency_key)


@router.get("", response_model=JobsPublic)
async def list_jobs(engine: EngineDep,
                    state: Annotated[Literal[JOB_STATES] | None, Query()] = None,  # type: ignore[valid-type]
                    kind: Annotated[Literal[JOB_KINDS] | None, Query()] = None,  # type: ignore[valid-type]
                    limit: Annotated[int, Query(ge=1, le=500)] = 50,
                    offset: Annotated[int, Query(ge=0, le=10**9)] = 0) -> Response:
    rows, count = await run_in_threadpool(queue.list_jobs, engine, state, kind, limit, offset)
    return as_json(JobsPublic(data=[JobPublic.from_row(r) for r in rows], count=count, limit=limit, offset=offset))


@router.get("/{job_id}", response_model=JobPublic)
async def get_job(job_id: JobId, engine: EngineDep) -> Response:
    return as_json(JobPublic.from_row(await run_in_threadpool(queue.get_job, engine, job_id)))


def as_json(model: BaseModel, status_code: int = 200) -> Response:
    """The hot read paths: one async route, one thread-pool call for the database, and the model
    serialised once by pydantic (a returned Response is not validated a second time)."""
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel_job(job_id: JobId, engine: EngineDep) -> JobPublic:
    return JobPublic.from_row(queue.cancel(engine, job_id))


@router.post("/{job_id}/retry", response_model=JobPublic)
def retry_job(job_id: JobId, engine: EngineDep) -> JobPublic:
    return JobPublic.from_row(queue.retry(engine, job_id))


@router.get("/{job_id}/metrics", response_model=list[MetricPublic])
def job_metrics(job_id: JobId, engine: EngineDep) -> list[dict]:
    return queue.get_metrics(engine, job_id)


@router.get("/{job_id}/events", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events"}})
async def job_events(job_id: JobId, engine: EngineDep, request: Request) -> StreamingResponse:
    """Server-Sent Events: `state` on every change of state or run, `epoch` for each epoch's metrics,
    then `end` when the job ends. Reconnecting replays the job's current state and all its epochs."""
    await run_in_threadpool(queue.get_job, engine, job_id)  # 404 before the stream starts

    async def stream():
        sent_state, last_epoch, idle = None, 0, 0.0
        while not await request.is_disconnected():
            job = await run_in_threadpool(queue.get_job, engine, job_id)
            state = (job["state"], job["claim"])
            if state != sent_state:
                if job["claim"] != (sent_state or ("", 0))[1] and job["state"] != "running":
                    # The run started and ended between two polls: still tell the client it ran.
                    yield _sse("state", JobPublic.from_row({**job, "state": "running"}).model_dump(mode="json"))
                if job["state"] == "running":
                    # A resumed run re-runs the epochs after its checkpoint: send them again.
                    last_epoch = min(last_epoch, job["checkpoint_epoch"] or 0)
                sent_state = state
                yield _sse("state", JobPublic.from_row(job).model_dump(mode="json"))
            for m in await run_in_threadpool(queue.get_metrics, engine, job_id, last_epoch):
                last_epoch = m["epoch"]
                yield _sse("epoch", m)
            if job["state"] in TERMINAL_STATES:
                yield _sse("end", {"id": job_id, "state": job["state"]})
                return
            await asyncio.sleep(EVENTS_POLL_S)
            idle += EVENTS_POLL_S
            if idle >= 15:  # a comment line keeps proxies from closing a quiet stream
                idle = 0.0
                yield ": keep-alive\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


@router.get("/{job_id}/result")
def job_result(job_id: JobId, engine: EngineDep) -> dict:
    job = queue.get_job(engine, job_id)
    if job["state"] != "succeeded":
        raise HTTPException(409, f"job {job_id} is {job['state']}; a result exists once it has succeeded")
    return job["result"]


ARTIFACT_FILES = {"safetensors": "model.safetensors", "pt": "model.pt", "meta": "meta.json"}


@router.get("/{job_id}/artifact", response_class=FileResponse,
            responses={200: {"content": {"application/octet-stream": {}}, "description": "the trained state_dict"}})
def job_artifact(job_id: JobId, engine: EngineDep, settings: SettingsDep,
                 format: Literal["safetensors", "pt", "meta"] = "safetensors") -> FileResponse:
    job = queue.get_job(engine, job_id)
    if job["kind"] != "train":
        raise HTTPException(404, f"job {job_id} is a {job['kind']} job; only train jobs have artifacts")
    if job["state"] != "succeeded" or not job["artifact_path"]:
        raise HTTPException(409, f"job {job_id} is {job['state']}; its artifact exists once it has succeeded")
    path = inside(settings.data_dir, Path(job["artifact_path"]) / ARTIFACT_FILES[format])
    if not path.is_file():
        raise HTTPException(410, f"the artifact of job {job_id} is gone from the data directory")
    name = ARTIFACT_FILES[format].replace("model", f"job-{job_id}-model").replace("meta", f"job-{job_id}-meta")
    media = "application/json" if format == "meta" else "application/octet-stream"
    return FileResponse(path, filename=name, media_type=media)


@router.get("/{job_id}/logs", response_class=PlainTextResponse)
def job_logs(job_id: JobId, engine: EngineDep, settings: SettingsDep) -> str:
    queue.get_job(engine, job_id)
    path = inside(settings.data_dir, Path("logs") / f"{job_id}.log")
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""


def inside(root: Path, rel: Path) -> Path:
    """Resolve rel under root, refusing anything that would land outside it."""
    base = root.resolve()
    path = (base / rel).resolve()
    if not path.is_relative_to(base):
        raise HTTPException(400, "path outside the data directory")
    return path
