"""Reading jobs: one job, a page of jobs within a byte budget, and a job's epoch records (its metrics).

Reads only; what changes a job is the queue's (app/jobs/queue.py).
"""
import functools
import json
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import JSON, Integer, Select, Text, and_, bindparam, cast, func, literal_column, select, true
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

from trainyard.app.core.errors import NotFound
from trainyard.app.core.states import JobState
from trainyard.app.db import jobs, metrics, read
from trainyard.app.records import Job


def ping(engine: Engine) -> None:
    """One trivial round trip to the database (/healthz, on the loop reader's engine: no BEGIN): plain SQL, nothing
    to build or compile."""
    with read(engine) as conn:
        conn.exec_driver_sql("SELECT 1").scalar_one()


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
              project: int | Literal[False] | None = None) -> tuple[list[Job], int]:
    """A page of jobs, newest first, and how many match (list_page's, on a connection of its own)."""
    with read(engine) as conn:
        return list_page(conn, state, kind, limit, offset, leave_out, sweep_id, max_bytes, project)


def list_page(conn: Connection, state: str | None = None, kind: str | None = None,
              limit: int = 50, offset: int = 0, leave_out: tuple[str, ...] = (),
              sweep_id: int | None = None, max_bytes: int | None = None,
              project: int | Literal[False] | None = None) -> tuple[list[Job], int]:
    """A page of jobs, newest first, and how many match. Columns in leave_out are not read (None in the records).
    project: the jobs of this project only (app/records/visibility.py's job_project); False: none; None: every job.
    With max_bytes the page ends before the row that would take its rows' stored JSON past it (the first
    row is always kept), so it may hold fewer than `limit` though more match: the database measures the
    page's rows' JSON first, and only the rows kept are read, their JSON as text, so a page costs about
    max_bytes whatever the rows hold (a hundred predict jobs' specs were 250 MB).
    Three statements whatever the page's size (count, sizes, rows), each built once per shape of filter."""
    if project is False:
        return [], 0
    made = _statements(sweep_id is not None, project is not None, bool(state), bool(kind),
                       tuple(sorted(set(leave_out))))
    params = {"sweep_id": sweep_id, "project_id": project, "state": state, "kind": kind,
              "limit": limit, "offset": offset}
    total = conn.execute(made.count, params).scalar_one()
    if max_bytes is None:
        return [Job.from_row(r) for r in conn.execute(made.rows, params)], total
    kept: list[int] = []
    used = 0
    for job_id, size in conn.execute(made.sizes, params):
        size = _ITEM_BYTES + (size or 0)
        if kept and used + size > max_bytes:
            break
        used += size
        kept.append(job_id)
    if not kept:
        return [], total
    # The kept ids are the head of the page: its id range, read under the same filter, holds them (and, were a row
    # committed in between, others, which are left out: the page is the one measured).
    result = conn.execute(made.kept, {**params, "lo": kept[-1], "hi": kept[0]})
    names = tuple(result.keys())  # once: Row._asdict looks them up again for every row
    got = {values["id"]: values for values in (dict(zip(names, r)) for r in result)}
    found: list[Job] = []
    for job_id in kept:
        values = got.get(job_id)
        if values is None:  # it no longer matches (its state changed, it was deleted)
            continue
        for name in made.json_read:
            if values[name] is not None:
                values[name] = json.loads(values[name])
        found.append(Job.from_values(values))
    return found, total


# A list item adds to its JSON columns' bytes (its other fields, as JSON), for a page's byte budget.
_ITEM_BYTES = 600
_JSON_COLUMNS = frozenset(c.name for c in jobs.c if isinstance(c.type, JSON))


@dataclass(frozen=True)
class _Page:
    count: Select       # how many match
    rows: Select        # the page itself (no byte budget)
    sizes: Select       # the page's ids, newest first, with their JSON columns' stored length
    kept: Select        # the rows of ids lo..hi that match, JSON columns as text
    json_read: tuple[str, ...]


@functools.cache
def _statements(sweep: bool, project: bool, state: bool, kind: bool, leave_out: tuple[str, ...]) -> _Page:
    """The list's statements for one shape of filter, built once: building and compiling them per request (and a
    statement per few rows) was most of a page's cost (issue 40). Values come as parameters."""
    conds = [column == bindparam(column.name) for on, column in ((sweep, jobs.c.sweep_id),
             (project, jobs.c.project_id), (state, jobs.c.state), (kind, jobs.c.kind)) if on]
    where = and_(true(), *conds)
    columns = [c for c in jobs.c if c.name not in leave_out]
    newest = jobs.c.id.desc()
    limit, offset = bindparam("limit", type_=Integer), bindparam("offset", type_=Integer)
    json_read = tuple(c.name for c in columns if c.name in _JSON_COLUMNS)
    zero: ColumnElement[int] = literal_column("0")
    size: ColumnElement[int] = sum((func.coalesce(func.length(cast(jobs.c[name], Text)), zero) for name in json_read),
                                   zero)
    return _Page(
        count=select(func.count()).select_from(jobs).where(where),
        rows=select(*columns).where(where).order_by(newest).limit(limit).offset(offset),
        sizes=select(jobs.c.id, size.label("size")).where(where).order_by(newest).limit(limit).offset(offset),
        kept=select(*(cast(c, Text).label(c.name) if c.name in _JSON_COLUMNS else c for c in columns))
        .where(where, jobs.c.id.between(bindparam("lo"), bindparam("hi"))),
        json_read=json_read)

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
