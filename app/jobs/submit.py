"""Submitting jobs: the INSERT of a queued job (alone, in a batch, or inside a sweep's transaction) with the jobs it
waits for (app/fleet/dependencies.py), and the spec as stored.

A submit's project limits on its jobs (queued_jobs, max_priority, stored_bytes: app/accounts/quotas.py) are checked
in the
transaction that inserts them, the project held from the check to the commit. A job's later state changes are the
queue's (app/jobs/queue.py); this module only adds new rows.
"""
import hashlib
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.exc import IntegrityError

from trainyard.app.accounts import Principal, quotas
from trainyard.app.core.errors import Conflict
from trainyard.app.core.states import JobState
from trainyard.app.db import counting, db_now, jobs, read, wakeup, write
from trainyard.app.fleet import dependencies
from trainyard.app.jobs import tracked
from trainyard.app.records import Job
from trainyard.app.spec import PredictJob, RunJob, TrainJob

QUEUED = JobState.QUEUED.value
KEY_CHARS = 200  # the idempotency_key column's length (app/db/tables.py)


def enqueue(engine: Engine, spec: TrainJob | PredictJob | RunJob, idempotency_key: str | None = None,
            parameters: int | None = None, needs: dict[str, str] | None = None,
            project_id: int | None = None, owner: str | None = None,
            who: Principal | None = None) -> tuple[Job, bool]:
    """Insert a queued job, in the project and owned by the user given, within who's project's limits (who: the
    submitter; None: none). Returns (job, created); the same idempotency key and body in the same project give
    the same job (in another project, another job), whatever the limits say now."""
    body = stored_spec(spec)
    key = None if idempotency_key is None else scoped_key(project_id, idempotency_key)
    try:
        with write(engine) as conn:
            held = quotas.hold(conn, who)  # first: a submit of the same key that went before has committed
            if key is not None:
                existing = conn.execute(select(jobs).where(jobs.c.idempotency_key == key)).first()
                if existing is not None:
                    return _same_key(existing, body), False
            quotas.admit(conn, held, [spec.priority])
            return insert_job(conn, spec, key, parameters, needs, body=body, project_id=project_id,
                              owner=owner), True
    except IntegrityError:
        # Two requests raced with one key (PostgreSQL): the other one inserted first.
        with read(engine) as conn:
            existing = conn.execute(select(jobs).where(jobs.c.idempotency_key == key)).first()
        if existing is None:
            raise
        return _same_key(existing, body), False


def enqueue_many(engine: Engine, specs: list[TrainJob | PredictJob | RunJob],
                 admitted: list[tuple[int | None, dict[str, str]]], project_id: int | None = None,
                 owner: str | None = None, who: Principal | None = None) -> list[Job]:
    """Insert a batch's jobs in one transaction, in order, each "$N" replaced by the id job N got, within who's
    project's limits (who: the submitter; None: none); admitted: each job's (parameters, needs)."""
    created: list[Job] = []
    with write(engine) as conn:
        quotas.admit(conn, quotas.hold(conn, who), [spec.priority for spec in specs], by="batch")
        for spec, (parameters, needs) in zip(specs, admitted, strict=True):
            resolved = dependencies.resolve(spec, [job.id for job in created])
            created.append(insert_job(conn, resolved, parameters=parameters, needs=needs, project_id=project_id,
                                      owner=owner))
    return created


def insert_job(conn: Connection, spec: TrainJob | PredictJob | RunJob, idempotency_key: str | None = None,
               parameters: int | None = None, needs: dict[str, str] | None = None,
               sweep: dict | None = None, body: dict | None = None, project_id: int | None = None,
               owner: str | None = None) -> Job:
    """Insert a queued job inside the caller's write transaction (a sweep's trial: sweep {"id", "trial", "params"}),
    in the project and owned by the user given (None: the admin's, as before accounts). idempotency_key: as
    stored (scoped_key)."""
    values: dict[str, Any] = dict(
        kind=spec.kind, name=spec.name, state=QUEUED, spec=body or stored_spec(spec), device_req=spec.device,
        priority=spec.priority, max_attempts=spec.max_attempts, timeout_s=spec.timeout_s,
        idempotency_key=idempotency_key, attempt=0, claim=0, created_at=db_now(), queued_at=db_now(), errors=[],
        epoch=0 if spec.kind == "train" else None,
        epochs=spec.train.epochs if spec.kind == "train" else getattr(spec, "epochs", None), parameters=parameters,
        need_gpu_memory=spec.gpu_memory_bytes, devices=spec.device_count,
        hosts=spec.host_count if spec.host_count > 1 else None,
        runs_on="slurm" if spec.runs_on == "slurm" else None,  # only its allocation's workers take it (app/clusters/)
        sweep_id=sweep["id"] if sweep else None, sweep=sweep, project_id=project_id, owner=owner,
        **{f"need_{kind[:-1]}": name for kind, name in (needs or {}).items()},
    )
    created = Job.from_row(conn.execute(insert(jobs).values(**values).returning(jobs)).one())
    dependencies.record(conn, created.id, spec)
    tracked.mark_job(conn, created.id, spec)
    counting.add(conn, counting.submitted(spec.kind))
    wakeup.notify(conn)
    return created


# Whole numbers below this are stored as integers: shorter than their float spelling ("0" for "0.0").
_WHOLE = 1e16


def stored_spec(spec: TrainJob | PredictJob | RunJob) -> dict:
    """The spec as stored: a predict job's whole-number inputs as integers, as a client sends them ("0", not
    "0.0": its rows are most of its bytes, and a float spelling made them 2.5 times the request). Read back,
    the job validates to the same floats."""
    body = spec.model_dump(mode="json")
    if body.get("inputs"):
        body["inputs"] = [[int(v) if isinstance(v, float) and v.is_integer() and -_WHOLE < v < _WHOLE else v
                           for v in row] for row in body["inputs"]]
    return body


def scoped_key(project_id: int | None, key: str) -> str:
    """An Idempotency-Key as stored: scoped to the project, so that the same key in two projects makes two jobs
    and no project ever meets another's. One too long for the column with its scope is stored as its digest
    ("#" after the scope, where a key as given has ":": the two never meet)."""
    scoped = f"{project_id or ''}:{key}"
    if len(scoped) <= KEY_CHARS:
        return scoped
    return f"{project_id or ''}#{hashlib.sha256(key.encode()).hexdigest()}"


def _same_key(existing: Row, body: dict) -> Job:
    if existing.spec != body:
        raise Conflict("Idempotency-Key was already used with a different body")
    return Job.from_row(existing)
