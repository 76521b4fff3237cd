"""Routes for jobs: submit, list, read, cancel, retry, delete, pin (what a job stored: routes/job_files.py; its
events: routes/events.py). A job belongs to the project its submitter's token names; a principal sees and acts on
its project's jobs only (admins: all), another project's answering 404 as a missing job does
(app/records/visibility.py).
Each change is written to the audit record."""
from typing import Annotated, Any, Literal

import pydantic_core
from fastapi import APIRouter, Body, Header, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.engine import Engine

from trainyard.app import db
from trainyard.app.accounts import Principal, audit
from trainyard.app.api.deps import EngineDep, SettingsDep, WhoDep, client_address
from trainyard.app.api.schemas import HEAVY, NOT_FOUND, JobPublic, JobsPublic, job_fields, responses
from trainyard.app.core.states import JobState
from trainyard.app.core.wire import NEXT_SINCE as NEXT_SINCE  # routes/job_files.py's page header, named here too
from trainyard.app.fleet import dependencies, waiting
from trainyard.app.jobs import admission, queue, submit
from trainyard.app.lifecycle import deletion
from trainyard.app.records import job_reads, job_summaries, visibility
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
from trainyard.app.tracking import reads as tracking_reads

router = APIRouter(prefix="/jobs", tags=["jobs"])
# Bounded so that no id reaches the database as an integer it cannot store.
INCLUDE_PATTERN = rf"^({'|'.join(HEAVY)})(,({'|'.join(HEAVY)}))*$"
JobId = Annotated[int, PathParam(ge=1, le=MAX_ID)]
# GET /jobs/{id}/metrics (routes/job_files.py) and its events: records per page. The header that says where the next
# page starts is core's, the client's too.
MAX_METRICS_PAGE = 10_000

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
                     settings: SettingsDep, who: WhoDep, request: Request,
                     idempotency_key: Annotated[str | None, Header(max_length=200, description=(
                         "a retried submit with the same key and body answers the first one's job (within the "
                         "project: another project's same key makes its own)"))] = None) -> Response:
    job, created, why = await run_in_threadpool(_submit, engine, settings, spec, idempotency_key, who,
                                                    client_address(request))
    return as_json(job_fields(job, why), 201 if created else 200)


def _submit(engine, settings, spec, idempotency_key, who: Principal, client: str | None):
    admitted = admission.admit(engine, settings, spec, waits=True, who=who)
    job, created = submit.enqueue(engine, spec, idempotency_key, admitted.parameters, admitted.needs,
                                  project_id=who.project_id, owner=who.user, who=who)
    if created:  # a retry answered with the job it made changed nothing
        audit.record(engine, who, "submit", f"job {job.id}", client, {"kind": job.kind})
    # A job that waits on another says so from the start (GET adds the fleet's view: workers, limits).
    return job, created, waiting.at_submit(engine, [job] if dependencies.names_any(spec) else []).get(job.id)


@router.post("/batch", status_code=201, response_model=list[JobPublic], operation_id="submit_jobs",
             responses=responses())
async def submit_jobs(specs: Annotated[JobBatch, Body(openapi_examples=BATCH_EXAMPLES)], engine: EngineDep,
                      settings: SettingsDep, who: WhoDep, request: Request) -> Response:
    """Several jobs at once, inserted in one transaction (all or none) and answered in order: a pipeline. A
    job may name an earlier job of the batch as "$N" (its position) in after, model_job or init_from, and waits
    for it as for any job it names."""
    created, why = await run_in_threadpool(_submit_batch, engine, settings, specs, who, client_address(request))
    return as_json([job_fields(job, why.get(job.id)) for job in created], 201)


def _submit_batch(engine, settings, specs, who: Principal, client: str | None):
    admitted = admission.admit_batch(engine, settings, specs, who)
    created = submit.enqueue_many(engine, specs, [(a.parameters, a.needs) for a in admitted],
                                  project_id=who.project_id, owner=who.user, who=who)
    batch = [job.id for job in created]
    for job in created:  # one record a job, each naming its batch
        audit.record(engine, who, "submit", f"job {job.id}", client, {"kind": job.kind, "batch": batch})
    named = [job for job, spec in zip(created, specs) if dependencies.names_any(spec)]
    return created, waiting.at_submit(engine, named)


@router.get("", response_model=JobsPublic, operation_id="list_jobs")
async def list_jobs(request: Request, who: WhoDep,
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
    """A page of the jobs you may see (your project's; an admin: all), newest first; `count` counts those only.
    Items are light: a job's spec, errors and result are left out unless `include` names them (GET /jobs/{id}
    has all of it); `summary` has what a list shows of the spec. A page holds about TRAINYARD_MAX_LIST_BYTES at
    most, whatever it includes: past it the page ends early (`truncated`), and `next_offset` is where the next page
    starts."""
    settings, reader = request.app.state.settings, request.app.state.reader  # as get_job: no dependencies to solve
    wanted = tuple(sorted(set(include.split(",")))) if include else ()
    project = visibility.job_project(who)
    leave_out = tuple(h for h in HEAVY if h not in wanted)

    def read_page(engine):
        # One connection for the page and what its items share (the workers, their dependencies, summaries):
        # a constant number of statements whatever the page's size (tests/api/test_hot_paths.py counts them).
        with db.read(engine) as conn:
            rows, count = job_reads.list_page(conn, state, kind, limit, offset, leave_out, sweep,
                                              settings.max_list_bytes, project)
            return rows, count, waiting.on_page(conn, settings, rows), job_summaries.summaries_on(conn, rows)
    rows, count, why, about = await reader.run(read_page)
    after = offset + len(rows)
    return as_json({"data": [job_fields(r, why.get(r.id), wanted, about.get(r.id)) for r in rows],
                    "count": count, "limit": limit, "offset": offset,
                    "truncated": len(rows) < min(limit, count - offset),
                    "next_offset": after if after < count else None})


@router.get("/{job_id}", response_model=JobPublic, responses=NOT_FOUND, operation_id="get_job")
async def get_job(job_id: JobId, request: Request, who: WhoDep) -> Response:
    # The app's state read here, not through dependencies: solving them was a tenth of this route's cost. (`who`
    # is the router's require_token, solved once per request.)
    settings, reader = request.app.state.settings, request.app.state.reader

    def read(engine):
        job = visibility.job_for(engine, who, job_id)
        why = waiting.of_jobs(engine, settings, [job]).get(job.id)
        return job, why, tracking_reads.of_job(engine, settings, job.id)
    job, why, tracking = await reader.run(read)
    return as_json({**job_fields(job, why), "tracking": tracking})


def as_json(values: dict | list, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """The hot paths: async routes that serialise plain values once, with pydantic's own JSON encoder
    (the same output as their response models; a returned Response is not validated again)."""
    return Response(pydantic_core.to_json(values), status_code=status_code, media_type="application/json",
                    headers=headers)


@router.post("/{job_id}/cancel", response_model=JobPublic, operation_id="cancel_job",
             responses={**NOT_FOUND, **responses(conflict="the job has ended already")})
def cancel_job(job_id: JobId, engine: EngineDep, who: WhoDep, request: Request) -> Response:
    visibility.job_for(engine, who, job_id)  # its project never changes: seen once, it stays seen
    job = queue.cancel(engine, job_id)
    _record(engine, who, request, "cancel", job_id)
    return as_json(job_fields(job, None))  # as GET /jobs/{id} shows it


@router.post("/{job_id}/retry", response_model=JobPublic, operation_id="retry_job",
             responses={**NOT_FOUND, **responses(conflict="only failed, cancelled or pruned jobs can be retried, "
                                                          "within the project's queued_jobs and stored_bytes")})
def retry_job(job_id: JobId, engine: EngineDep, who: WhoDep, request: Request) -> Response:
    visibility.job_for(engine, who, job_id)
    job = queue.retry(engine, job_id, who)  # a submit again: held to who's project's limits
    _record(engine, who, request, "retry", job_id)
    return as_json(job_fields(job, None))


@router.delete("/{job_id}", status_code=204, response_class=Response, operation_id="delete_job",
               responses={**NOT_FOUND, **responses(conflict="something keeps it: it is queued or running, pinned, "
                                                             "named by a job that has not ended, or the best trial "
                                                             "of a running sweep (the detail says which)")})
def delete_job(job_id: JobId, engine: EngineDep, settings: SettingsDep, who: WhoDep, request: Request) -> Response:
    """Delete an ended job: its rows (the job, its metrics) and every stored object (artifacts, exports,
    checkpoints, log). Its id then answers 404. A job something still refers to stays, with 409 naming that."""
    visibility.job_for(engine, who, job_id)
    deletion.delete_job(engine, settings.store, job_id)
    _record(engine, who, request, "delete", job_id)
    return Response(status_code=204)


@router.post("/{job_id}/pin", response_model=JobPublic, operation_id="pin_job", responses=NOT_FOUND)
def pin_job(job_id: JobId, engine: EngineDep, who: WhoDep, request: Request) -> Response:
    """Keep the job from deletion (its model is in use elsewhere) until it is unpinned."""
    return _pin(engine, who, request, job_id, True)


@router.post("/{job_id}/unpin", response_model=JobPublic, operation_id="unpin_job", responses=NOT_FOUND)
def unpin_job(job_id: JobId, engine: EngineDep, who: WhoDep, request: Request) -> Response:
    return _pin(engine, who, request, job_id, False)


def _pin(engine: Engine, who: Principal, request: Request, job_id: int, pinned: bool) -> Response:
    visibility.job_for(engine, who, job_id)
    job = deletion.pin(engine, job_id, pinned)
    _record(engine, who, request, "pin" if pinned else "unpin", job_id)
    return as_json(job_fields(job, None))


def _record(engine: Engine, who: Principal, request: Request, action: str, job_id: int,
            detail: dict[str, Any] | None = None) -> None:
    """The audit record of an action on a job, once it has succeeded."""
    audit.record(engine, who, action, f"job {job_id}", client_address(request), detail)
