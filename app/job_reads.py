"""Reading jobs: one job, a page of jobs within a byte budget, and a job's epoch records (its metrics).

Reads only; what changes a job is the queue's (app/queue.py).
"""
import json

from sqlalchemy import JSON, Text, and_, bindparam, cast, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.sql.elements import ColumnElement

from trainyard.app.db import jobs, metrics, read
from trainyard.app.errors import NotFound
from trainyard.app.records import Job
from trainyard.app.states import JobState


def ping(engine: Engine) -> None:
    with read(engine) as conn:
        conn.execute(select(1)).scalar_one()


# Built once: the statement clients poll most (GET /jobs/{id}); building it per call took half its time.
_JOB_BY_ID = select(jobs).where(jobs.c.id == bindparam("job_id"))


def get_job(engine: Engine, job_id: int) -> Job:
    with read(engine) as conn:
        row = conn.execute(_JOB_BY_ID, {"job_id": job_id}).first()
    if row is None:
        raise NotFound(f"job {job_id} not found")
    return Job.from_row(row)


def claimed_since(engine: Engine, job_id: int, claim_no: int) -> bool:
    """Whether another claim of the job has begun since claim_no (or the job is gone): what claim_no's
    run may still write outside the database, its log in a bucket, it may write only while this is False."""
    with read(engine) as conn:
        return conn.execute(select(jobs.c.id).where(jobs.c.id == job_id, jobs.c.claim == claim_no)).first() is None


def why_lost(engine: Engine, job_id: int, claim_no: int) -> str:
    """Why claim_no's run of the job no longer holds it, for that run's log: the job was cancelled or pruned (its
    error's words), taken over by another claim, queued again, or deleted."""
    with read(engine) as conn:
        row = conn.execute(select(jobs.c.state, jobs.c.claim, jobs.c.worker_id, jobs.c.error)
                           .where(jobs.c.id == job_id)).first()
    if row is None:
        return "deleted"
    if row.claim != claim_no:
        return f"taken over: run {row.claim} of it is {row.state}" + (f" on {row.worker_id}" if row.worker_id else "")
    if row.state == JobState.QUEUED:
        return "queued again: its lease ran out"
    message = str((row.error or {}).get("message") or "")
    return message if message.startswith(row.state) else f"{row.state}: {message}" if message else row.state

def list_jobs(engine: Engine, state: str | None = None, kind: str | None = None,
              limit: int = 50, offset: int = 0, leave_out: tuple[str, ...] = (),
              sweep_id: int | None = None, max_bytes: int | None = None,
              scope: ColumnElement[bool] | None = None) -> tuple[list[Job], int]:
    """A page of jobs, newest first, and how many match. Columns in leave_out are not read (None in the records).
    scope: a condition every row listed and counted meets (app/visibility.py's job_scope: a project's jobs).
    With max_bytes the page ends before the row that would take its rows' stored JSON past it (the first
    row is always kept), so it may hold fewer than `limit` though more match: its rows are read a few at
    a time, their JSON as text, and parsed only once kept, so a page costs about max_bytes whatever the
    rows hold (a hundred predict jobs' specs were 250 MB)."""
    conds = [] if sweep_id is None else [jobs.c.sweep_id == sweep_id]
    if scope is not None:
        conds.append(scope)
    if state:
        conds.append(jobs.c.state == state)
    if kind:
        conds.append(jobs.c.kind == kind)
    where = and_(True, *conds)
    with read(engine) as conn:
        total = conn.execute(select(func.count()).select_from(jobs).where(where)).scalar_one()
        columns = [c for c in jobs.c if c.name not in leave_out]
        if max_bytes is None:
            rows = conn.execute(select(*columns).where(where).order_by(jobs.c.id.desc()).limit(limit)
                                .offset(offset)).all()
            return [Job.from_row(r) for r in rows], total
        ids = conn.execute(select(jobs.c.id).where(where).order_by(jobs.c.id.desc()).limit(limit)
                           .offset(offset)).scalars().all()
        as_text = select(*(cast(c, Text).label(c.name) if c.name in _JSON_COLUMNS else c for c in columns))
        found: list[Job] = []
        used = 0
        for i in range(0, len(ids), _PAGE_BATCH):
            batch = ids[i:i + _PAGE_BATCH]
            got = {r.id: r._asdict() for r in conn.execute(as_text.where(jobs.c.id.in_(batch)))}
            for job_id in batch:
                values = got.get(job_id)
                if values is None:
                    continue
                stored = [name for name in _JSON_COLUMNS if values.get(name) is not None]
                size = _ITEM_BYTES + sum(len(values[name]) for name in stored)
                if found and used + size > max_bytes:
                    return found, total
                used += size
                values.update({name: json.loads(values[name]) for name in stored})
                found.append(Job.from_values(values))
    return found, total


# A page's rows are read this many at a time (max_bytes): a few rows' JSON at once, whatever they hold.
_PAGE_BATCH = 8
_JSON_COLUMNS = frozenset(c.name for c in jobs.c if isinstance(c.type, JSON))
# What a list item adds to its JSON columns' bytes (its other fields, as JSON), for a page's byte budget.
_ITEM_BYTES = 600

def get_metrics(engine: Engine, job_id: int, after_epoch: int = 0) -> list[dict]:
    get_job(engine, job_id)
    with read(engine) as conn:
        rows = conn.execute(select(metrics.c.epoch, metrics.c.attempt, metrics.c.data)
                            .where(metrics.c.job_id == job_id, metrics.c.epoch > after_epoch)
                            .order_by(metrics.c.epoch)).all()
    return [{"epoch": r.epoch, "attempt": r.attempt, **r.data} for r in rows]


def metrics_page(engine: Engine, job_id: int, after_epoch: int = 0, limit: int = 10_000,
                 max_bytes: int | None = None) -> tuple[list[dict], bool]:
    """The job's epoch records after `after_epoch`, oldest first: at most `limit` of them and about max_bytes of
    stored JSON (the first always), and whether more follow. Read a batch at a time as text, each record parsed
    only once kept: a job that reported megabytes an epoch costs a page, not its whole history."""
    get_job(engine, job_id)
    out: list[dict] = []
    used, batch = 0, 32
    with read(engine) as conn:
        while len(out) < limit:
            want = min(batch, limit - len(out))
            rows = conn.execute(select(metrics.c.epoch, metrics.c.attempt, cast(metrics.c.data, Text).label("data"))
                                .where(metrics.c.job_id == job_id, metrics.c.epoch > after_epoch)
                                .order_by(metrics.c.epoch).limit(want)).all()
            for r in rows:
                size = len(r.data) + 30
                if out and max_bytes is not None and used + size > max_bytes:
                    return out, True
                used += size
                out.append({"epoch": r.epoch, "attempt": r.attempt, **json.loads(r.data)})
                after_epoch = r.epoch
            if len(rows) < want:
                return out, False
            if max_bytes is not None:  # as many as the rest of the budget holds at the size seen so far
                batch = max(8, min(1000, (max_bytes - used) * len(out) // max(used, 1) + 1))
        more = conn.execute(select(metrics.c.id).where(metrics.c.job_id == job_id, metrics.c.epoch > after_epoch)
                            .limit(1)).first() is not None
    return out, more
