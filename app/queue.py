"""The queue: the only code that changes a job's state.

Every transition is one guarded UPDATE. Writes a worker makes about a job are fenced by the claim
number it got when it claimed the job (`WHERE id = ? AND claim = ? AND state = 'running'`): a worker
that lost its lease (paused, partitioned, too slow) changes nothing. Times come from the database's
clock (db.db_now) so that hosts with skewed clocks agree on leases.
"""
from typing import Any

from sqlalchemy import and_, case, delete, func, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from app.db import db_now, jobs, metrics, read, workers, write
from app.spec import PredictJob, TrainJob

# Failure classes. Only infrastructure failures (worker lost, lease expired, killed by a signal)
# are retried automatically: retrying a job's own error or an out-of-memory would fail the same way.
JOB_ERROR, INFRASTRUCTURE, OOM, TIMEOUT, CANCELLED = "job", "infrastructure", "oom", "timeout", "cancelled"
RETRYABLE = {INFRASTRUCTURE}


class QueueError(Exception):
    """The queue refused the operation."""


class NotFound(QueueError):
    """No such job."""


class Conflict(QueueError):
    """The job is not in a state that allows this."""


def _d(row) -> dict[str, Any] | None:
    # Plain str keys: SQLAlchemy's key type would make every job process that unpickles a job
    # import SQLAlchemy (~150 ms).
    return {str(k): v for k, v in row._mapping.items()} if row is not None else None


def accepted_devices(device: str) -> list[str]:
    """Which job device requests a worker on `device` may take."""
    if device == "cpu":
        return ["auto", "cpu"]
    return ["auto", "cuda", device]


# ---- submitting and reading -------------------------------------------------------------------

def enqueue(engine: Engine, spec: TrainJob | PredictJob, idempotency_key: str | None = None) -> tuple[dict, bool]:
    """Insert a queued job. Returns (job, created); the same idempotency key and body give the same job."""
    body = spec.model_dump(mode="json")
    values = dict(
        kind=spec.kind, name=spec.name, state="queued", spec=body, device_req=spec.device,
        priority=spec.priority, max_attempts=spec.max_attempts, timeout_s=spec.timeout_s,
        idempotency_key=idempotency_key, attempt=0, claim=0, created_at=db_now(), errors=[],
        epoch=0 if spec.kind == "train" else None,
        epochs=spec.train.epochs if spec.kind == "train" else None,
    )
    try:
        with write(engine) as conn:
            if idempotency_key is not None:
                existing = conn.execute(select(jobs).where(jobs.c.idempotency_key == idempotency_key)).first()
                if existing is not None:
                    return _same_key(existing, body), False
            return _d(conn.execute(insert(jobs).values(**values).returning(jobs)).one()), True
    except IntegrityError:
        # Two requests raced with one key (PostgreSQL): the other one inserted first.
        with read(engine) as conn:
            existing = conn.execute(select(jobs).where(jobs.c.idempotency_key == idempotency_key)).first()
        if existing is None:
            raise
        return _same_key(existing, body), False


def _same_key(existing, body: dict) -> dict:
    if existing.spec != body:
        raise Conflict("Idempotency-Key was already used with a different body")
    return _d(existing)


def get_job(engine: Engine, job_id: int) -> dict:
    with read(engine) as conn:
        row = conn.execute(select(jobs).where(jobs.c.id == job_id)).first()
    if row is None:
        raise NotFound(f"job {job_id} not found")
    return _d(row)


def list_jobs(engine: Engine, state: str | None = None, kind: str | None = None,
              limit: int = 50, offset: int = 0) -> tuple[list[dict], int]:
    conds = []
    if state:
        conds.append(jobs.c.state == state)
    if kind:
        conds.append(jobs.c.kind == kind)
    where = and_(True, *conds)
    with read(engine) as conn:
        total = conn.execute(select(func.count()).select_from(jobs).where(where)).scalar_one()
        rows = conn.execute(select(jobs).where(where).order_by(jobs.c.id.desc()).limit(limit).offset(offset)).all()
    return [_d(r) for r in rows], total

def get_metrics(engine: Engine, job_id: int, after_epoch: int = 0) -> list[dict]:
    get_job(engine, job_id)
    with read(engine) as conn:
        rows = conn.execute(select(metrics.c.epoch, metrics.c.attempt, metrics.c.data)
                            .where(metrics.c.job_id == job_id, metrics.c.epoch > after_epoch)
                            .order_by(metrics.c.epoch)).all()
    return [{"epoch": r.epoch, "attempt": r.attempt, **r.data} for r in rows]


def stats(engine: Engine, buckets: tuple[float, ...]) -> dict[str, Any]:
    """Aggregates for monitoring, computed by the database: jobs by kind and state, a histogram of
    finished jobs' durations (cumulative counts per bucket, sum, count), and running jobs' speed."""
    duration = jobs.c.finished_at - jobs.c.started_at
    finished = jobs.c.state.in_(("succeeded", "failed")) & jobs.c.started_at.is_not(None)
    with read(engine) as conn:
        by_state = conn.execute(select(jobs.c.kind, jobs.c.state, func.count())
                                .group_by(jobs.c.kind, jobs.c.state)).all()
        hist = conn.execute(select(
            jobs.c.kind, func.count(), func.coalesce(func.sum(duration), 0.0),
            *[func.sum(case((duration <= b, 1), else_=0)) for b in buckets],
        ).where(finished).group_by(jobs.c.kind)).all()
        running = conn.execute(select(jobs.c.id, jobs.c.kind, jobs.c.device, jobs.c.latest_metrics)
                               .where(jobs.c.state == "running")).all()
    return {
        "by_state": {(k, s): n for k, s, n in by_state},
        "durations": {row[0]: {"count": row[1], "sum": float(row[2]), "buckets": [int(v or 0) for v in row[3:]]}
                      for row in hist},
        "running": [{"id": r.id, "kind": r.kind, "device": r.device,
                     "samples_per_s": (r.latest_metrics or {}).get("samples_per_s")} for r in running],
    }


# ---- client actions ---------------------------------------------------------------------------

def cancel(engine: Engine, job_id: int) -> dict:
    """Cancel a queued or running job. A running job's worker sees its fence fail and stops the process."""
    error = {"class": CANCELLED, "type": "Cancelled", "message": "cancelled by request"}
    with write(engine) as conn:
        row = conn.execute(select(jobs.c.state, jobs.c.errors, jobs.c.attempt).where(jobs.c.id == job_id)).first()
        if row is None:
            raise NotFound(f"job {job_id} not found")
        if row.state not in ("queued", "running"):
            raise Conflict(f"job {job_id} is {row.state}; only queued or running jobs can be cancelled")
        new = conn.execute(
            update(jobs).where(jobs.c.id == job_id, jobs.c.state == row.state)
            .values(state="cancelled", finished_at=db_now(), lease_expires_at=None,
                    error=error, errors=[*(row.errors or []), {**error, "attempt": row.attempt}])
            .returning(jobs)).one()
    return _d(new)


def retry(engine: Engine, job_id: int) -> dict:
    """Requeue a failed or cancelled job under the same id; it resumes from its last checkpoint."""
    with write(engine) as conn:
        new = conn.execute(
            update(jobs).where(jobs.c.id == job_id, jobs.c.state.in_(("failed", "cancelled")))
            .values(state="queued", attempt=0, finished_at=None, error=None, worker_id=None,
                    lease_expires_at=None, result=None)
            .returning(jobs)).first()
        if new is None:
            state = conn.execute(select(jobs.c.state).where(jobs.c.id == job_id)).scalar()
            if state is None:
                raise NotFound(f"job {job_id} not found")
            raise Conflict(f"job {job_id} is {state}; only failed or cancelled jobs can be retried")
    return _d(new)


# ---- the worker's side ------------------------------------------------------------------------

def has_work(engine: Engine, device: str) -> bool:
    """A cheap read so idle workers can poll often without taking SQLite's write lock."""
    with read(engine) as conn:
        return conn.execute(select(jobs.c.id).where(
            jobs.c.state == "queued", jobs.c.device_req.in_(accepted_devices(device))).limit(1)).first() is not None


def claim(engine: Engine, worker_id: str, device: str, lease_s: float) -> dict | None:
    """Atomically take the next queued job this device accepts: highest priority first, then oldest.

    One UPDATE ... WHERE id = (SELECT ... LIMIT 1) RETURNING: under BEGIN IMMEDIATE on SQLite, and
    with FOR UPDATE SKIP LOCKED on PostgreSQL (SQLite ignores it), so no two workers get one job.
    """
    next_id = (select(jobs.c.id)
               .where(jobs.c.state == "queued", jobs.c.device_req.in_(accepted_devices(device)))
               .order_by(jobs.c.priority.desc(), jobs.c.id).limit(1)
               .with_for_update(skip_locked=True).scalar_subquery())
    with write(engine) as conn:
        row = conn.execute(
            update(jobs).where(jobs.c.id == next_id, jobs.c.state == "queued")
            .values(state="running", attempt=jobs.c.attempt + 1, claim=jobs.c.claim + 1,
                    worker_id=worker_id, device=device, started_at=db_now(), finished_at=None,
                    lease_expires_at=db_now() + lease_s,
                    epoch=case((jobs.c.kind == "train", func.coalesce(jobs.c.checkpoint_epoch, 0)), else_=None))
            .returning(jobs)).first()
        if row is None:
            return None
        # Epochs after the last checkpoint will be run again: drop their old records so the
        # metrics history has neither a gap nor a duplicate epoch.
        conn.execute(delete(metrics).where(metrics.c.job_id == row.id,
                                           metrics.c.epoch > (row.checkpoint_epoch or 0)))
    return _d(row)


def _fenced(job_id: int, claim_no: int):
    return and_(jobs.c.id == job_id, jobs.c.claim == claim_no, jobs.c.state == "running")


def renew(engine: Engine, job_id: int, claim_no: int, lease_s: float) -> bool:
    """Extend the lease. False means the job is no longer ours (cancelled, or taken over)."""
    with write(engine) as conn:
        res = conn.execute(update(jobs).where(_fenced(job_id, claim_no))
                           .values(lease_expires_at=db_now() + lease_s))
    return res.rowcount == 1


def still_ours(engine: Engine, job_id: int, claim_no: int) -> bool:
    with read(engine) as conn:
        return conn.execute(select(jobs.c.id).where(_fenced(job_id, claim_no))).first() is not None


def record_progress(engine: Engine, job_id: int, claim_no: int, epochs: list[tuple[int, dict]],
                    checkpoint: tuple[int, str] | None = None) -> bool:
    """Record finished epochs' metrics and the latest checkpoint in one transaction (a fast job can
    finish many epochs between two of its worker's looks at the pipe)."""
    with write(engine) as conn:
        row = conn.execute(select(jobs.c.attempt, jobs.c.peak_memory_allocated, jobs.c.peak_memory_reserved)
                           .where(_fenced(job_id, claim_no))).first()
        if row is None:
            return False
        values: dict[str, Any] = {}
        if epochs:
            peak_a, peak_r = row.peak_memory_allocated, row.peak_memory_reserved
            for _, data in epochs:
                peak_a = _max(peak_a, data.get("max_memory_allocated"))
                peak_r = _max(peak_r, data.get("max_memory_reserved", data.get("memory_reserved")))
            last_epoch, last_data = epochs[-1]
            values.update(epoch=last_epoch, latest_metrics={"epoch": last_epoch, **last_data},
                          peak_memory_allocated=peak_a, peak_memory_reserved=peak_r)
            now = conn.execute(select(db_now())).scalar_one()
            conn.execute(insert(metrics), [dict(job_id=job_id, epoch=e, attempt=row.attempt, data=d, created_at=now)
                                           for e, d in epochs])
        if checkpoint is not None:
            values.update(checkpoint_epoch=checkpoint[0], checkpoint_path=checkpoint[1])
        if values:
            conn.execute(update(jobs).where(_fenced(job_id, claim_no)).values(**values))
    return True


def record_epoch(engine: Engine, job_id: int, claim_no: int, epoch: int, data: dict) -> bool:
    return record_progress(engine, job_id, claim_no, [(epoch, data)])


def record_checkpoint(engine: Engine, job_id: int, claim_no: int, epoch: int, path: str) -> bool:
    return record_progress(engine, job_id, claim_no, [], (epoch, path))


def _max(a, b):
    return b if a is None else a if b is None else max(a, b)


def succeed(engine: Engine, job_id: int, claim_no: int, result: dict, artifact_path: str | None) -> bool:
    with write(engine) as conn:
        res = conn.execute(update(jobs).where(_fenced(job_id, claim_no)).values(
            state="succeeded", finished_at=db_now(), lease_expires_at=None, result=result,
            artifact_path=artifact_path, error=None,
            peak_memory_allocated=func.coalesce(result.get("peak_memory_allocated"), jobs.c.peak_memory_allocated),
            peak_memory_reserved=func.coalesce(result.get("peak_memory_reserved"), jobs.c.peak_memory_reserved)))
    return res.rowcount == 1


def fail(engine: Engine, job_id: int, claim_no: int, error: dict) -> str | None:
    """Record a failed run. Retryable classes go back to the queue while attempts remain.

    Returns the new state, or None if the job was no longer ours.
    """
    with write(engine) as conn:
        row = conn.execute(select(jobs.c.attempt, jobs.c.max_attempts, jobs.c.errors)
                           .where(_fenced(job_id, claim_no)).with_for_update()).first()
        if row is None:
            return None
        return _fail_row(conn, job_id, claim_no, row, error)


def _fail_row(conn, job_id: int, claim_no: int, row, error: dict) -> str:
    retry_it = error["class"] in RETRYABLE and row.attempt < row.max_attempts
    if error["class"] in RETRYABLE and not retry_it:
        error = {**error, "message": f"{error['message']} (gave up after {row.attempt} attempts)"}
    history = [*(row.errors or []), {**error, "attempt": row.attempt}]
    values: dict[str, Any] = dict(error=error, errors=history, lease_expires_at=None)
    if retry_it:
        values.update(state="queued", worker_id=None)
    else:
        values.update(state="failed", finished_at=db_now())
    conn.execute(update(jobs).where(_fenced(job_id, claim_no)).values(**values))
    return values["state"]


def requeue_preempted(engine: Engine, job_id: int, claim_no: int) -> bool:
    """The worker is shutting down: put the job back without using up an attempt."""
    with write(engine) as conn:
        res = conn.execute(update(jobs).where(_fenced(job_id, claim_no)).values(
            state="queued", attempt=jobs.c.attempt - 1, worker_id=None, lease_expires_at=None))
    return res.rowcount == 1


def requeue_expired(engine: Engine) -> list[tuple[int, str]]:
    """Jobs whose lease ran out (worker killed, host gone) go back to the queue, or fail past max_attempts."""
    with read(engine) as conn:
        expired = conn.execute(select(jobs.c.id, jobs.c.claim).where(
            jobs.c.state == "running", jobs.c.lease_expires_at < db_now())).all()
    out = []
    for job_id, claim_no in expired:
        error = {"class": INFRASTRUCTURE, "type": "LeaseExpired",
                 "message": "the worker stopped renewing its lease (killed, hung or disconnected)"}
        with write(engine) as conn:
            row = conn.execute(select(jobs.c.attempt, jobs.c.max_attempts, jobs.c.errors).where(
                _fenced(job_id, claim_no), jobs.c.lease_expires_at < db_now()).with_for_update()).first()
            if row is not None:
                out.append((job_id, _fail_row(conn, job_id, claim_no, row, error)))
    return out


# ---- workers ----------------------------------------------------------------------------------

def register_worker(engine: Engine, worker_id: str, host: str, pid: int, device: str, stats: dict) -> None:
    with write(engine) as conn:
        conn.execute(insert(workers).values(id=worker_id, host=host, pid=pid, device=device, state="idle",
                                            stats=stats, started_at=db_now(), last_heartbeat=db_now()))


def worker_heartbeat(engine: Engine, worker_id: str, state: str, job_id: int | None,
                     stats: dict | None = None) -> None:
    values: dict[str, Any] = dict(state=state, job_id=job_id, last_heartbeat=db_now())
    if stats is not None:
        values["stats"] = stats
    with write(engine) as conn:
        conn.execute(update(workers).where(workers.c.id == worker_id).values(**values))


def list_workers(engine: Engine, include_stopped: bool = False) -> tuple[list[dict], float]:
    """Workers and the database's current time (to judge heartbeat age)."""
    with read(engine) as conn:
        now = conn.execute(select(db_now())).scalar_one()
        q = select(workers).order_by(workers.c.started_at)
        if not include_stopped:
            q = q.where(workers.c.state != "stopped")
        rows = conn.execute(q).all()
    return [_d(r) for r in rows], now


def worker_state(worker: dict, now: float, stale_after_s: float) -> str:
    """A worker's state as others should read it: 'lost' once it has missed a lease's worth of heartbeats."""
    if worker["state"] != "stopped" and now - worker["last_heartbeat"] > stale_after_s:
        return "lost"
    return worker["state"]


class Invalid(QueueError):
    """The request is well-formed but refers to something that cannot be used."""

    def __init__(self, loc: tuple, message: str):
        super().__init__(message)
        self.loc = loc


def check_predict(engine: Engine, spec: PredictJob) -> None:
    """A predict job must name a succeeded train job, and its inputs must have the model's width."""
    try:
        model_job = get_job(engine, spec.model_job)
    except NotFound:
        raise Invalid(("model_job",), f"model_job {spec.model_job} does not exist")
    if model_job["kind"] != "train":
        raise Invalid(("model_job",), f"model_job {spec.model_job} is a {model_job['kind']} job, not a train job")
    if model_job["state"] != "succeeded":
        raise Invalid(("model_job",), f"model_job {spec.model_job} is {model_job['state']}; it must have succeeded")
    shape = (model_job["result"] or {}).get("input_shape")
    if spec.inputs is not None and shape:
        width = 1
        for n in shape:
            width *= n
        if len(spec.inputs[0]) != width:
            raise Invalid(("inputs",), f"inputs rows have {len(spec.inputs[0])} values; model_job "
                                       f"{spec.model_job} takes {width} (input shape {list(shape)})")
