"""Routes for what a job has stored: its metrics, result, artifact (the model, its meta, its exports), log and
TensorBoard event files, each served to a principal that may see the job (another project's answers 404, as a missing
job does)."""
import asyncio
import itertools
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse

from trainyard.app.api.deps import EngineDep, SettingsDep, WhoDep
from trainyard.app.api.routes.jobs import MAX_METRICS_PAGE, NEXT_SINCE, JobId, as_json
from trainyard.app.api.schemas import NOT_FOUND, MetricPublic, responses
from trainyard.app.api.schemas_results import FullJobResult
from trainyard.app.core import storage
from trainyard.app.core.errors import Conflict, Gone, NotFound
from trainyard.app.core.layout import ARTIFACT_FILES, EXPORT_FILES, RESULT_FILE
from trainyard.app.core.states import JobState
from trainyard.app.jobs import event_archive, exports
from trainyard.app.records import job_reads, visibility

router = APIRouter(prefix="/jobs", tags=["jobs"])
EVENTS_POLL_S = 0.25  # how often an export's wait checks that its client is still there
METRIC_BLANKS = {name: None for name in MetricPublic.model_fields if name not in ("epoch", "attempt")}
MAX_EPOCH = 2**31 - 1  # the epoch column's integer
BINARY = {"type": "string", "format": "binary"}


@router.get("/{job_id}/metrics", response_model=list[MetricPublic], operation_id="job_metrics",
            responses={200: {"headers": {NEXT_SINCE: {"description": "more records follow: ask again with since=it",
                                                      "schema": {"type": "integer"}}}}, **NOT_FOUND})
def job_metrics(job_id: JobId, engine: EngineDep, settings: SettingsDep, who: WhoDep,
                since: Annotated[int, Query(ge=0, le=MAX_EPOCH, description="records after this epoch")] = 0,
                limit: Annotated[int, Query(ge=1, le=MAX_METRICS_PAGE)] = MAX_METRICS_PAGE) -> Response:
    """The job's epoch records after `since`, oldest first: at most `limit`, and about TRAINYARD_MAX_LIST_BYTES
    (the first always). When more follow, the `X-Next-Since` header holds the `since` of the next page."""
    visibility.job_for(engine, who, job_id)
    records, more = job_reads.metrics_page(engine, job_id, since, limit, settings.max_list_bytes)
    # Every declared field in every record, null where an epoch did not report it (as response_model did).
    records = [{**METRIC_BLANKS, **r} for r in records]
    return as_json(records, headers={NEXT_SINCE: str(records[-1]["epoch"])} if more and records else None)


@router.get("/{job_id}/result", response_model=FullJobResult, operation_id="job_result",
            responses={**NOT_FOUND, **responses(conflict="the job has not succeeded", gone="its file is gone")})
def job_result(job_id: JobId, engine: EngineDep, settings: SettingsDep, who: WhoDep) -> Response:
    """The whole result. A prediction's rows and an evaluation's confusion matrix live in a file beside
    the job's run (streamed from storage here); the job itself carries only their summary."""
    job = visibility.job_for(engine, who, job_id)
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
async def job_artifact(job_id: JobId, engine: EngineDep, settings: SettingsDep, request: Request, who: WhoDep,
                       format: Literal["safetensors", "pt", "meta", "onnx", "pt2", "torchscript"] = "safetensors"
                       ) -> Response:
    """The job's model. onnx, pt2 and torchscript take float32 rows of raw values, (N, width) like a
    predict job's `inputs`, and return class probabilities; each is exported on its first request
    (seconds) and served from the store after that."""
    job = await run_in_threadpool(visibility.job_for, engine, who, job_id)
    if job.kind == "predict":
        raise NotFound(f"job {job_id} is a predict job; train jobs (and run jobs that save a model) have artifacts")
    if job.state == JobState.SUCCEEDED and job.reclaimed and not job.artifact_path:  # app/lifecycle/retention.py
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


@router.get("/{job_id}/tensorboard", response_class=StreamingResponse, operation_id="job_tensorboard",
            responses={200: {"content": {"application/octet-stream": {"schema": BINARY}},
                             "description": "a .tar.gz of <job_id>/<event file>, every run's"},
                       **responses(not_found="no such job, or one without event files")})
def job_tensorboard(job_id: JobId, engine: EngineDep, settings: SettingsDep, who: WhoDep) -> Response:
    """The job's TensorBoard event files (a train job's, or a run job's that reported epochs: its metrics per
    epoch, hyperparameters and final metrics) as a .tar.gz, packed from storage as it streams: unpack archives
    into one folder and run `tensorboard --logdir` on it (`trainyard tensorboard` does both)."""
    visibility.job_for(engine, who, job_id)
    entries = event_archive.event_files(settings.store, job_id)
    if not entries:
        raise NotFound(f"job {job_id} has no TensorBoard event files (a train or run job writes them from its "
                       "first epoch; they go with its model)")
    return StreamingResponse(event_archive.archive(settings.store, job_id, entries),
                             media_type="application/octet-stream",  # generated clients take it as bytes
                             headers={"Content-Disposition": f'attachment; filename="job-{job_id}-tensorboard.tar.gz"'})


LOG_SIZE, LOG_START = "X-Log-Size", "X-Log-Start"
MAX_LOG_BYTE = 1 << 50


@router.get("/{job_id}/logs", response_class=PlainTextResponse, operation_id="job_logs",
            responses={200: {"headers": {
                LOG_SIZE: {"description": "the log's size in bytes when read", "schema": {"type": "integer"}},
                LOG_START: {"description": "the byte of the log this answer starts at",
                            "schema": {"type": "integer"}}}},
                **NOT_FOUND})
def job_logs(job_id: JobId, engine: EngineDep, settings: SettingsDep, who: WhoDep,
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
    visibility.job_for(engine, who, job_id)
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

