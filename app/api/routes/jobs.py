"""Routes for jobs: submit, list, read, cancel, retry, delete, pin, metrics, artifact, result, logs (events:
routes/events.py)."""
import asyncio
import itertools
from typing import Annotated, Literal

import pydantic_core
from fastapi import APIRouter, Body, Header, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse

from trainyard.app import admission, deletion, exports, job_reads, job_summaries, queue, storage, submit
from trainyard.app.api.deps import EngineDep, ReaderDep, SettingsDep
from trainyard.app.api.schemas import (
    HEAVY,
    NOT_FOUND,
    JobPublic,
    JobResult,
    JobsPublic,
    MetricPublic,
    job_fields,
    responses,
)
from trainyard.app.errors import Conflict, Gone, NotFound
from trainyard.app.layout import ARTIFACT_FILES, EXPORT_FILES, RESULT_FILE
from trainyard.app.spec import (
    JOB_KINDS,
    MAX_ID,
    PIPELINE_EXAMPLE,
    PREDICT_DATA_EXAMPLE,
    PREDICT_INPUTS_EXAMPLE,
    TRAIN_EXAMPLE,
    JobBatch,
    JobSpec,
)
from trainyard.app.states import JobState

router = APIRouter(prefix="/jobs", tags=["jobs"])
# Bounded so that no id reaches the database as an integer it cannot store.
INCLUDE_PATTERN = rf"^({'|'.join(HEAVY)})(,({'|'.join(HEAVY)}))*$"
JobId = Annotated[int, PathParam(ge=1, le=MAX_ID)]
EVENTS_POLL_S = 0.25
# GET /jobs/{id}/metrics: records per page, and the header that says where the next page starts.
MAX_METRICS_PAGE = 10_000
NEXT_SINCE = "X-Next-Since"
METRIC_BLANKS = {name: None for name in MetricPublic.model_fields if name not in ("epoch", "attempt")}
MAX_EPOCH = 2**31 - 1  # the epoch column's integer

EXAMPLES = {
    "train": {"summary": "Train an MLP on Iris", "value": TRAIN_EXAMPLE},
    "predict_inputs": {"summary": "Predict classes for rows of features", "value": PREDICT_INPUTS_EXAMPLE},
    "predict_data": {"summary": "Evaluate on the validation split", "value": PREDICT_DATA_EXAMPLE},
}

BATCH_EXAMPLES = {"pipeline": {"summary": "Train, evaluate on the held-out split, predict", "value": PIPELINE_EXAMPLE}}


@router.post("", status_code=201, response_model=JobPublic, operation_id="submit_job",
             responses={200: {"model": JobPublic, "description": "the same Idempotency-Key and body: the job it made"},
                        **responses(conflict="the Idempotency-Key was used with another body")})
async def submit_job(spec: Annotated[JobSpec, Body(openapi_examples=EXAMPLES)], engine: EngineDep,
                     settings: SettingsDep,
                     idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> Response:
    job, created = await run_in_threadpool(_submit, engine, settings, spec, idempotency_key)
    return as_json(job_fields(job, None), 201 if created else 200)


def _submit(engine, settings, spec, idempotency_key):
    admitted = admission.admit(engine, settings, spec, waits=True)
    return submit.enqueue(engine, spec, idempotency_key, admitted.parameters, admitted.needs)


@router.post("/batch", status_code=201, response_model=list[JobPublic], operation_id="submit_jobs",
             responses=responses())
async def submit_jobs(specs: Annotated[JobBatch, Body(openapi_examples=BATCH_EXAMPLES)], engine: EngineDep,
                      settings: SettingsDep) -> Response:
    """Several jobs at once, inserted in one transaction (all or none) and answered in order: a pipeline. A
    job may name an earlier job of the batch as "$N" (its position) in after, model_job or init_from, and waits
    for it as for any job it names."""
    created = await run_in_threadpool(_submit_batch, engine, settings, specs)
    return as_json([job_fields(job, None) for job in created], 201)


def _submit_batch(engine, settings, specs):
    admitted = admission.admit_batch(engine, settings, specs)
    return submit.enqueue_many(engine, specs, [(a.parameters, a.needs) for a in admitted])


@router.get("", response_model=JobsPublic, operation_id="list_jobs")
async def list_jobs(settings: SettingsDep, reader: ReaderDep,
                    state: Annotated[JobState | None, Query()] = None,
                    kind: Annotated[Literal[JOB_KINDS] | None, Query()] = None,  # type: ignore[valid-type]
                    limit: Annotated[int, Query(ge=1, le=500)] = 50,
                    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
                    sweep: Annotated[int | None, Query(ge=1, le=MAX_ID, description="a sweep's trials")] = None,
                    include: Annotated[str | None, Query(
                        pattern=INCLUDE_PATTERN, max_length=40, examples=["spec,result"],
                        description="comma-separated: spec, errors, result (left out of list items by default)",
                    )] = None,
                    ) -> Response:
    """A page of jobs, newest first. Items are light: a job's spec, errors and result are left out
    unless `include` names them (GET /jobs/{id} has all of it); `summary` has what a list shows of the spec.
    A page holds about TRAINYARD_MAX_LIST_BYTES at most, whatever it includes: past it the page ends early
    (`truncated`), and `next_offset` is where the next page starts."""
    wanted = tuple(sorted(set(include.split(",")))) if include else ()

    def read(engine):
        rows, count = job_reads.list_jobs(engine, state, kind, limit, offset, sweep_id=sweep,
                                          leave_out=tuple(h for h in HEAVY if h not in wanted),
                                          max_bytes=settings.max_list_bytes)
        return rows, count, admission.why_waiting(engine, settings, rows), job_summaries.summaries(engine, rows)
    rows, count, waiting, about = await reader.run(read)
    after = offset + len(rows)
    return as_json({"data": [job_fields(r, waiting.get(r.id), wanted, about.get(r.id)) for r in rows],
                    "count": count, "limit": limit, "offset": offset,
                    "truncated": len(rows) < min(limit, count - offset),
                    "next_offset": after if after < count else None})


@router.get("/{job_id}", response_model=JobPublic, responses=NOT_FOUND, operation_id="get_job")
async def get_job(job_id: JobId, request: Request) -> Response:
    # The app's state read here, not through dependencies: solving them was a tenth of this route's cost.
    settings, reader = request.app.state.settings, request.app.state.reader

    def read(engine):
        job = job_reads.get_job(engine, job_id)
        return job, admission.why_waiting(engine, settings, [job]).get(job.id)
    job, waiting = await reader.run(read)
    return as_json(job_fields(job, waiting))


def as_json(values: dict | list, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """The hot paths: async routes that serialise plain values once, with pydantic's own JSON encoder
    (the same output as their response models; a returned Response is not validated again)."""
    return Response(pydantic_core.to_json(values), status_code=status_code, media_type="application/json",
                    headers=headers)


@router.post("/{job_id}/cancel", response_model=JobPublic, operation_id="cancel_job",
             responses={**NOT_FOUND, **responses(conflict="the job has ended already")})
def cancel_job(job_id: JobId, engine: EngineDep) -> Response:
    return as_json(job_fields(queue.cancel(engine, job_id), None))  # as GET /jobs/{id} shows it


@router.post("/{job_id}/retry", response_model=JobPublic, operation_id="retry_job",
             responses={**NOT_FOUND, **responses(conflict="only failed, cancelled or pruned jobs can be retried")})
def retry_job(job_id: JobId, engine: EngineDep) -> Response:
    return as_json(job_fields(queue.retry(engine, job_id), None))


@router.delete("/{job_id}", status_code=204, response_class=Response, operation_id="delete_job",
               responses={**NOT_FOUND, **responses(conflict="something keeps it: it is queued or running, pinned, "
                                                             "named by a job that has not ended, or the best trial "
                                                             "of a running sweep (the detail says which)")})
def delete_job(job_id: JobId, engine: EngineDep, settings: SettingsDep) -> Response:
    """Delete an ended job: its rows (the job, its metrics) and every stored object (artifacts, exports,
    checkpoints, log). Its id then answers 404. A job something still refers to stays, with 409 naming that."""
    deletion.delete_job(engine, settings.store, job_id)
    return Response(status_code=204)


@router.post("/{job_id}/pin", response_model=JobPublic, operation_id="pin_job", responses=NOT_FOUND)
def pin_job(job_id: JobId, engine: EngineDep) -> Response:
    """Keep the job from deletion (its model is in use elsewhere) until it is unpinned."""
    return as_json(job_fields(deletion.pin(engine, job_id), None))


@router.post("/{job_id}/unpin", response_model=JobPublic, operation_id="unpin_job", responses=NOT_FOUND)
def unpin_job(job_id: JobId, engine: EngineDep) -> Response:
    return as_json(job_fields(deletion.pin(engine, job_id, False), None))


@router.get("/{job_id}/metrics", response_model=list[MetricPublic], operation_id="job_metrics",
            responses={200: {"headers": {NEXT_SINCE: {"description": "more records follow: ask again with since=it",
                                                      "schema": {"type": "integer"}}}}, **NOT_FOUND})
def job_metrics(job_id: JobId, engine: EngineDep, settings: SettingsDep,
                since: Annotated[int, Query(ge=0, le=MAX_EPOCH, description="records after this epoch")] = 0,
                limit: Annotated[int, Query(ge=1, le=MAX_METRICS_PAGE)] = MAX_METRICS_PAGE) -> Response:
    """The job's epoch records after `since`, oldest first: at most `limit`, and about TRAINYARD_MAX_LIST_BYTES
    (the first always). When more follow, the `X-Next-Since` header holds the `since` of the next page."""
    records, more = job_reads.metrics_page(engine, job_id, since, limit, settings.max_list_bytes)
    # Every declared field in every record, null where an epoch did not report it (as response_model did).
    records = [{**METRIC_BLANKS, **r} for r in records]
    return as_json(records, headers={NEXT_SINCE: str(records[-1]["epoch"])} if more and records else None)


@router.get("/{job_id}/result", response_model=JobResult, operation_id="job_result",
            responses={**NOT_FOUND, **responses(conflict="the job has not succeeded", gone="its file is gone")})
def job_result(job_id: JobId, engine: EngineDep, settings: SettingsDep) -> Response:
    """The whole result. A prediction's rows and an evaluation's confusion matrix live in a file beside
    the job's run (streamed from storage here); the job itself carries only their summary."""
    job = job_reads.get_job(engine, job_id)
    if job.state != JobState.SUCCEEDED:
        raise Conflict(f"job {job_id} is {job.state}; a result exists once it has succeeded")
    if job.kind == "predict" and job.artifact_path:
        try:
            return _stored(settings.store, f"{job.artifact_path}/{RESULT_FILE}", "application/json")
        except FileNotFoundError:
            raise Gone(f"the result of job {job_id} is gone from {settings.store.describe()}") from None
    return JSONResponse(job.result)


@router.get("/{job_id}/artifact", response_class=FileResponse, operation_id="job_artifact",
            responses={200: {"content": {"application/octet-stream": {}},
                             "description": "the trained state_dict (safetensors, pt), its meta.json, or the model "
                                            "exported with its input normalisation built in (onnx, pt2, torchscript)"},
                       **responses(not_found="no such job, or one without a model",
                                   conflict="the job has not succeeded, or its model cannot be rebuilt to export it",
                                   gone="its files are gone (a sweep trial's, removed by retention: the detail "
                                        "says why)"),
                       503: {"description": "too many exports are waiting (TRAINYARD_EXPORT_QUEUE); see Retry-After"}})
async def job_artifact(job_id: JobId, engine: EngineDep, settings: SettingsDep, request: Request,
                       format: Literal["safetensors", "pt", "meta", "onnx", "pt2", "torchscript"] = "safetensors"
                       ) -> Response:
    """The job's model. onnx, pt2 and torchscript take float32 rows of raw values, (N, width) like a
    predict job's `inputs`, and return class probabilities; each is exported on its first request
    (seconds) and served from the store after that."""
    job = await run_in_threadpool(job_reads.get_job, engine, job_id)
    if job.kind == "predict":
        raise NotFound(f"job {job_id} is a predict job; train jobs (and run jobs that save a model) have artifacts")
    if job.state == JobState.SUCCEEDED and job.reclaimed and not job.artifact_path:  # app/retention.py
        raise Gone(f"the model of job {job_id} was removed by retention: {job.reclaimed.get('why')}")
    if job.state != JobState.SUCCEEDED or not job.artifact_path:
        raise Conflict(f"job {job_id} is {job.state}; its artifact exists once it has succeeded")
    media = "application/json" if format == "meta" else "application/octet-stream"
    try:
        if format in EXPORT_FILES:
            key = await exports.exported(settings, job, format, gone=lambda: _hung_up(request))
            name = f"job-{job_id}-{EXPORT_FILES[format]}"
        else:
            key = f"{job.artifact_path}/{ARTIFACT_FILES[format]}"
            name = ARTIFACT_FILES[format].replace("model", f"job-{job_id}-model").replace("meta", f"job-{job_id}-meta")
        return await run_in_threadpool(_stored, settings.store, key, media, name)
    except FileNotFoundError:
        if job.kind == "run":
            raise NotFound(f"run job {job_id} saved no model (ctx.save_model)") from None
        raise Gone(f"the artifact of job {job_id} is gone from {settings.store.describe()}") from None


async def _hung_up(request: Request) -> None:
    """Returns when the client has hung up (an export nobody waits for is stopped)."""
    while not await request.is_disconnected():
        await asyncio.sleep(EVENTS_POLL_S)


def _stored(store: storage.Store, key: str, media_type: str, filename: str | None = None) -> Response:
    """A stored file as the response, streamed in chunks (never whole in memory); FileNotFoundError if missing."""
    if not store.remote:
        path = store.fetch(key)
        return FileResponse(path, filename=filename, media_type=media_type)
    size = store.size(key)
    headers = {"Content-Length": str(size)}
    if filename:
        headers["Content-Disposition"] = f'attachment; filename="{filename}"'
    return StreamingResponse(store.stream(key), media_type=media_type, headers=headers)


LOG_SIZE, LOG_START = "X-Log-Size", "X-Log-Start"
MAX_LOG_BYTE = 1 << 50


@router.get("/{job_id}/logs", response_class=PlainTextResponse, operation_id="job_logs",
            responses={200: {"headers": {
                LOG_SIZE: {"description": "the log's size in bytes when read", "schema": {"type": "integer"}},
                LOG_START: {"description": "the byte of the log this answer starts at",
                            "schema": {"type": "integer"}}}},
                **NOT_FOUND})
def job_logs(job_id: JobId, engine: EngineDep, settings: SettingsDep,
             tail: Annotated[int | None, Query(ge=1, le=MAX_LOG_BYTE, description=(
                 "the last this many bytes at most, from the first whole line in them"))] = None,
             offset: Annotated[int, Query(ge=0, le=MAX_LOG_BYTE, description=(
                 "from this byte on (to follow a log: the X-Log-Size of the last read)"))] = 0) -> Response:
    """What the job printed, its worker's lines about it and its traceback, streamed from storage (never
    whole in memory); the log itself is held to TRAINYARD_JOB_LOG_BYTES. X-Log-Size is the log's size
    when read, X-Log-Start where this answer starts: a log that shrank below your offset was trimmed."""
    if tail is not None and offset:
        raise RequestValidationError([{"loc": ("query", "tail"), "msg": "give tail or offset, not both",
                                       "type": "value_error", "input": tail}])
    job_reads.get_job(engine, job_id)
    key = settings.layout.rel(settings.layout.log(job_id))
    try:  # with tail, one byte more: whether the window starts a line
        size, first, chunks = settings.store.read_range(key, offset, None if tail is None else tail + 1)
    except FileNotFoundError:
        size, first, chunks = 0, 0, iter(())
    lead = next(chunks, b"")
    if tail is not None and size > tail:
        cut = lead.find(b"\n", 0, len(lead)) + 1 or 1  # through the line the window starts in; else the extra byte
        lead, first = lead[cut:], first + cut
    headers = {LOG_SIZE: str(size), LOG_START: str(first), "Content-Length": str(size - first)}
    return StreamingResponse(itertools.chain((lead,), chunks), media_type="text/plain; charset=utf-8",
                             headers=headers)

