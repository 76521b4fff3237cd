"""The queue: the only code that changes a job's state.

Every transition is one guarded UPDATE. Writes a worker makes about a job are fenced by the claim
number it got when it claimed the job (`WHERE id = ? AND claim = ? AND state = 'running'`): a worker
that lost its lease (paused, partitioned, too slow) changes nothing. Times come from the database's
clock (db.db_now) so that hosts with skewed clocks agree on leases.
"""
import json
from typing import Any

from sqlalchemy import JSON, Text, and_, bindparam, case, cast, delete, func, insert, literal_column, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from trainyard.app import placement, wakeup
from trainyard.app.db import db_now, jobs, metrics, read, workers, write
from trainyard.app.errors import Conflict, NotFound
from trainyard.app.records import Job
from trainyard.app.spec import PredictJob, RunJob, TrainJob
from trainyard.app.states import RETRYABLE, Failure, JobState, error_record

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = (s.value for s in JobState)


# ---- submitting and reading -------------------------------------------------------------------

def enqueue(engine: Engine, spec: TrainJob | PredictJob | RunJob, idempotency_key: str | None = None,
            parameters: int | None = None, needs: dict[str, str] | None = None) -> tuple[Job, bool]:
    """Insert a queued job. Returns (job, created); the same idempotency key and body give the same job."""
    body = stored_spec(spec)
    try:
        with write(engine) as conn:
            if idempotency_key is not None:
                existing = conn.execute(select(jobs).where(jobs.c.idempotency_key == idempotency_key)).first()
                if existing is not None:
                    return _same_key(existing, body), False
            return insert_job(conn, spec, idempotency_key, parameters, needs, body=body), True
    except IntegrityError:
        # Two requests raced with one key (PostgreSQL): the other one inserted first.
        with read(engine) as conn:
            existing = conn.execute(select(jobs).where(jobs.c.idempotency_key == idempotency_key)).first()
        if existing is None:
            raise
        return _same_key(existing, body), False


def insert_job(conn, spec: TrainJob | PredictJob | RunJob, idempotency_key: str | None = None,
               parameters: int | None = None, needs: dict[str, str] | None = None,
               sweep: dict | None = None, body: dict | None = None) -> Job:
    """Insert a queued job inside the caller's write transaction (a sweep's trial: sweep {"id", "trial", "params"})."""
    values = dict(
        kind=spec.kind, name=spec.name, state=QUEUED, spec=body or stored_spec(spec), device_req=spec.device,
        priority=spec.priority, max_attempts=spec.max_attempts, timeout_s=spec.timeout_s,
        idempotency_key=idempotency_key, attempt=0, claim=0, created_at=db_now(), errors=[],
        epoch=0 if spec.kind == "train" else None,
        epochs=spec.train.epochs if spec.kind == "train" else getattr(spec, "epochs", None), parameters=parameters,
        need_gpu_memory=spec.gpu_memory_bytes, devices=spec.device_count,
        sweep_id=sweep["id"] if sweep else None, sweep=sweep,
        **{f"need_{kind[:-1]}": name for kind, name in (needs or {}).items()},
    )
    created = Job.from_row(conn.execute(insert(jobs).values(**values).returning(jobs)).one())
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


def _same_key(existing, body: dict) -> Job:
    if existing.spec != body:
        raise Conflict("Idempotency-Key was already used with a different body")
    return Job.from_row(existing)


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


def list_jobs(engine: Engine, state: str | None = None, kind: str | None = None,
              limit: int = 50, offset: int = 0, leave_out: tuple[str, ...] = (),
              sweep_id: int | None = None, max_bytes: int | None = None) -> tuple[list[Job], int]:
    """A page of jobs, newest first, and how many match. Columns in leave_out are not read (None in the records).
    With max_bytes the page ends before the row that would take its rows' stored JSON past it (the first
    row is always kept), so it may hold fewer than `limit` though more match: its rows are read a few at
    a time, their JSON as text, and parsed only once kept, so a page costs about max_bytes whatever the
    rows hold (a hundred predict jobs' specs were 250 MB)."""
    conds = [] if sweep_id is None else [jobs.c.sweep_id == sweep_id]
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


def spec_summary(kind: str, spec: dict, rows: int | None = None) -> dict[str, Any]:
    """What a list item shows of a job's spec (`summary`): its model and dataset (train); its model job and
    rows, or dataset and split (predict); its entrypoint (run). rows: the inputs' count, for a spec read without them."""
    data = spec.get("data") or {}
    if kind == "predict":
        if isinstance(spec.get("inputs"), list):
            rows = len(spec["inputs"])
        about = {"model_job": spec.get("model_job"), "rows": rows, "dataset": data.get("dataset"),
                 "split": data.get("split")}
    elif kind == "run":
        about = {"entrypoint": spec.get("entrypoint")}
    else:
        about = {"arch": (spec.get("model") or {}).get("arch"), "dataset": data.get("dataset")}
    return {k: v for k, v in about.items() if v is not None}


# (id, created_at) -> the job's summary: a spec never changes once stored, so each server process reads
# a job's once. Bounded: past this many it starts over.
_SUMMARIES: dict[tuple[int, float], dict] = {}
_SUMMARIES_KEPT = 20_000
_SUMMARY_PATHS = ("model_job", "model.arch", "data.dataset", "data.split", "entrypoint")


def summaries(engine: Engine, found: list[Job]) -> dict[int, dict]:
    """Each job's spec_summary, without reading its spec into this process: the database's JSON functions
    pick out the few fields (and a prediction's row count), once per job; records that carry their spec
    (read with it) are summed up from it."""
    out: dict[int, dict] = {}
    missing = []
    for job in found:
        if job.spec is not None:
            out[job.id] = spec_summary(job.kind, job.spec)
        elif (job.id, job.created_at) in _SUMMARIES:
            out[job.id] = _SUMMARIES[(job.id, job.created_at)]
        else:
            missing.append(job.id)
    if not missing:
        return out
    with read(engine) as conn:
        rows = conn.execute(select(jobs.c.id, jobs.c.kind, jobs.c.created_at, *_summary_columns(conn.dialect.name))
                            .where(jobs.c.id.in_(missing))).all()
    if len(_SUMMARIES) + len(rows) > _SUMMARIES_KEPT:
        _SUMMARIES.clear()
    for r in rows:
        parts = json.loads(r.parts) if r.parts else [None] * len(_SUMMARY_PATHS)
        spec: dict[str, Any] = {}
        for path, value in zip(_SUMMARY_PATHS, parts):  # back into the spec's shape: "model.arch" -> model.arch
            *outer, last = path.split(".")
            node = spec
            for key in outer:
                node = node.setdefault(key, {})
            node[last] = value
        _SUMMARIES[(r.id, r.created_at)] = out[r.id] = spec_summary(r.kind, spec, r.rows)
    return out


def _summary_columns(dialect: str) -> list:
    """The summary's fields as one JSON array (`parts`, in _SUMMARY_PATHS' order) and the inputs' length (`rows`)."""
    if dialect == "postgresql":
        paths = ", ".join(f"jobs.spec#>'{{{p.replace('.', ',')}}}'" for p in _SUMMARY_PATHS)
        return [literal_column(f"CAST(json_build_array({paths}) AS TEXT)").label("parts"),
                literal_column("CASE WHEN json_typeof(jobs.spec->'inputs') = 'array' "
                               "THEN json_array_length(jobs.spec->'inputs') END").label("rows")]
    paths = ", ".join(f"'$.{p}'" for p in _SUMMARY_PATHS)
    return [literal_column(f"json_extract(jobs.spec, {paths})").label("parts"),
            literal_column("CASE WHEN json_type(jobs.spec, '$.inputs') = 'array' "
                           "THEN json_array_length(jobs.spec, '$.inputs') END").label("rows")]


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


# ---- client actions ---------------------------------------------------------------------------

def cancel(engine: Engine, job_id: int) -> Job:
    """Cancel a queued or running job. A running job's worker sees its fence fail and stops the process."""
    error = error_record(Failure.CANCELLED, "Cancelled", "cancelled by request")
    with write(engine) as conn:
        # FOR UPDATE: on PostgreSQL a worker's write to the row (it finished, failed, was requeued) commits either
        # before this read, which then sees it, or after this transaction; SQLite's BEGIN IMMEDIATE already holds.
        row = conn.execute(select(jobs.c.id, jobs.c.state, jobs.c.errors, jobs.c.attempt)
                           .where(jobs.c.id == job_id).with_for_update()).first()
        if row is None:
            raise NotFound(f"job {job_id} not found")
        new = _end(conn, row, CANCELLED, error) if row.state in (QUEUED, RUNNING) else None
        if new is None:  # it had ended already (or, without the lock, ended in between): say how it is now
            state = conn.execute(select(jobs.c.state).where(jobs.c.id == job_id)).scalar()
            raise Conflict(f"job {job_id} is {state}; only queued or running jobs can be cancelled")
        wakeup.notify(conn)  # a queued job's cancel can unblock the line behind it
    return Job.from_row(new)


def stop(engine: Engine, job_ids: list[int], error: dict, states: tuple[str, ...] = (QUEUED, RUNNING),
         final: str = CANCELLED) -> list[int]:
    """End each job still in one of `states` with `error` (a sweep cancelling its trials, pruning one):
    one guarded UPDATE per job, so a job that has just ended keeps its own ending. The jobs' workers see
    their fence fail and stop the processes (within FENCE_CHECK_S plus the kill grace); the metrics
    recorded so far stay. Returns the ids it ended."""
    with write(engine) as conn:
        rows = conn.execute(select(jobs.c.id, jobs.c.state, jobs.c.errors, jobs.c.attempt)
                            .where(jobs.c.id.in_(job_ids), jobs.c.state.in_(states))).all()
        ended = [row.id for row in rows if _end(conn, row, final, error) is not None]
        if ended:
            wakeup.notify(conn)
    return ended


def _end(conn, row, final: str, error: dict):
    """End a job that was in row.state (guarded by it) as `final` with `error` added to its history;
    the new row, or None if its state changed first."""
    return conn.execute(
        update(jobs).where(jobs.c.id == row.id, jobs.c.state == row.state)
        .values(state=final, finished_at=db_now(), lease_expires_at=None, error=error,
                errors=[*(row.errors or []), {**error, "attempt": row.attempt}])
        .returning(jobs)).first()


def retry(engine: Engine, job_id: int) -> Job:
    """Requeue a failed or cancelled job under the same id; it resumes from its last checkpoint."""
    with write(engine) as conn:
        new = conn.execute(
            update(jobs).where(jobs.c.id == job_id, jobs.c.state.in_((FAILED, CANCELLED)))
            .values(state=QUEUED, attempt=0, finished_at=None, error=None, worker_id=None,
                    lease_expires_at=None, result=None)
            .returning(jobs)).first()
        if new is None:
            state = conn.execute(select(jobs.c.state).where(jobs.c.id == job_id)).scalar()
            if state is None:
                raise NotFound(f"job {job_id} not found")
            raise Conflict(f"job {job_id} is {state}; only failed or cancelled jobs can be retried")
        wakeup.notify(conn)
    return Job.from_row(new)


# ---- the worker's side ------------------------------------------------------------------------

def has_work(engine: Engine, device: str, plugins: dict[str, list[str]] | None = None,
             worker_id: str | None = None, slot: placement.Slot | None = None, lease_s: float = 30.0) -> bool:
    """A cheap read so idle workers can poll often without taking SQLite's write lock."""
    with read(engine) as conn:
        return _startable(conn, device, plugins, worker_id, slot, lease_s, lock=False) is not None


def _startable(conn, device, plugins, worker_id, slot, lease_s, lock: bool) -> tuple[int, list[dict]] | None:
    """The job at the head of this worker's line, if it can start now, and the other ranks it would
    borrow (none for a one-device job). A head that cannot start holds the worker back (no backfill)."""
    head = conn.execute(select(jobs.c.id, jobs.c.devices).where(
        jobs.c.id == placement.head(device, plugins, worker_id, slot), placement.fits_now(slot))).first()
    if head is None:
        return None
    if slot is not None and device != "cpu" and slot.key in placement.lent_gpus(conn):
        return None  # this worker's GPU is a rank of another worker's multi-device job
    if (head.devices or 1) == 1:
        return head.id, []
    if worker_id is None:
        return None
    others = placement.helpers(conn, worker_id, device, head.devices - 1, lease_s, lock=lock)
    return None if others is None else (head.id, others)


# The PostgreSQL advisory lock claims take turns on (any constant; this one spells "tyclaim" in ASCII).
CLAIM_LOCK = 0x7479636C61696D


def claim(engine: Engine, worker_id: str, device: str, lease_s: float,
          plugins: dict[str, list[str]] | None = None, slot: placement.Slot | None = None) -> Job | None:
    """Atomically take the next queued job this worker can run: highest priority first, then oldest.

    Claims take turns: BEGIN IMMEDIATE on SQLite, a transaction-scoped advisory lock on PostgreSQL.
    So no two workers get one job, two workers sharing a device cannot both count the same free
    memory, a worker cannot lend its device to another's multi-device job while claiming a job of its
    own, and no worker looks past a head of the line that another is looking at (row locks with SKIP
    LOCKED alone let a worker skip a multi-device head that another worker was finding it could not
    start yet, and overtake it). A claim takes a few milliseconds.
    """
    with write(engine) as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(select(func.pg_advisory_xact_lock(CLAIM_LOCK)))
        found = _startable(conn, device, plugins, worker_id, slot, lease_s, lock=True)
        if found is None:
            return None
        job_id, others = found
        ranks = [{"worker": worker_id, "device": device, "key": slot.key if slot else worker_id}, *others] \
            if others else None
        row = conn.execute(
            update(jobs).where(jobs.c.id == job_id, jobs.c.state == QUEUED)
            .values(state=RUNNING, attempt=jobs.c.attempt + 1, claim=jobs.c.claim + 1,
                    worker_id=worker_id, device=device, started_at=db_now(), finished_at=None,
                    lease_expires_at=db_now() + lease_s, gpu_key=slot.key if slot else None, ranks=ranks,
                    epoch=case((jobs.c.kind != "predict", func.coalesce(jobs.c.checkpoint_epoch, 0)), else_=None))
            .returning(jobs)).first()
        if row is None:
            return None
        if others:
            conn.execute(update(workers).where(workers.c.id.in_([o["worker"] for o in others]))
                         .values(lent_to=row.id, lent_claim=row.claim))
        # Epochs after the last checkpoint will be run again: drop their old records so the
        # metrics history has neither a gap nor a duplicate epoch.
        conn.execute(delete(metrics).where(metrics.c.job_id == row.id,
                                           metrics.c.epoch > (row.checkpoint_epoch or 0)))
    return Job.from_row(row)


def _fenced(job_id: int, claim_no: int):
    return and_(jobs.c.id == job_id, jobs.c.claim == claim_no, jobs.c.state == RUNNING)


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
                    checkpoint: tuple[int, str] | None = None, total: int | None = None) -> bool:
    """Record finished epochs' metrics, the latest checkpoint and the number of epochs to expect, in
    one transaction (a fast job can finish many epochs between two of its worker's looks at the pipe).
    An epoch recorded again replaces its record: a run that starts over writes its own history."""
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
            latest = dict(epochs)  # the last report of an epoch wins
            conn.execute(delete(metrics).where(metrics.c.job_id == job_id, metrics.c.epoch.in_(list(latest))))
            conn.execute(insert(metrics), [dict(job_id=job_id, epoch=e, attempt=row.attempt, data=d, created_at=now)
                                           for e, d in latest.items()])
        if checkpoint is not None:
            values.update(checkpoint_epoch=checkpoint[0], checkpoint_path=checkpoint[1])
        if total is not None:
            values.update(epochs=total)
        if values:
            conn.execute(update(jobs).where(_fenced(job_id, claim_no)).values(**values))
    return True


def start_over(engine: Engine, job_id: int, claim_no: int) -> bool:
    """The run could not read the checkpoint it was to resume from and starts from scratch: forget the
    checkpoint and the earlier runs' metrics, so the history is this run's alone."""
    with write(engine) as conn:
        res = conn.execute(update(jobs).where(_fenced(job_id, claim_no)).values(
            checkpoint_path=None, checkpoint_epoch=None, epoch=0, latest_metrics=None))
        if res.rowcount == 1:
            conn.execute(delete(metrics).where(metrics.c.job_id == job_id))
    return res.rowcount == 1


def record_epoch(engine: Engine, job_id: int, claim_no: int, epoch: int, data: dict) -> bool:
    return record_progress(engine, job_id, claim_no, [(epoch, data)])


def record_checkpoint(engine: Engine, job_id: int, claim_no: int, epoch: int, path: str) -> bool:
    return record_progress(engine, job_id, claim_no, [], (epoch, path))


def _max(a, b):
    return b if a is None else a if b is None else max(a, b)


def succeed(engine: Engine, job_id: int, claim_no: int, result: dict, artifact_path: str | None) -> bool:
    with write(engine) as conn:
        res = conn.execute(update(jobs).where(_fenced(job_id, claim_no)).values(
            state=SUCCEEDED, finished_at=db_now(), lease_expires_at=None, result=result,
            artifact_path=artifact_path, error=None,
            peak_memory_allocated=func.coalesce(result.get("peak_memory_allocated"), jobs.c.peak_memory_allocated),
            peak_memory_reserved=func.coalesce(result.get("peak_memory_reserved"), jobs.c.peak_memory_reserved)))
        wakeup.notify(conn)  # its device is free: a job waiting for room may start
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
        values.update(state=QUEUED, worker_id=None)
    else:
        values.update(state=FAILED, finished_at=db_now())
    conn.execute(update(jobs).where(_fenced(job_id, claim_no)).values(**values))
    wakeup.notify(conn)  # queued again, or ended: either gives some worker something to do
    return values["state"]


def requeue_preempted(engine: Engine, job_id: int, claim_no: int) -> bool:
    """The worker is shutting down: put the job back without using up an attempt."""
    with write(engine) as conn:
        res = conn.execute(update(jobs).where(_fenced(job_id, claim_no)).values(
            state=QUEUED, attempt=jobs.c.attempt - 1, worker_id=None, lease_expires_at=None))
        wakeup.notify(conn)
    return res.rowcount == 1


def requeue_expired(engine: Engine) -> list[tuple[int, str]]:
    """Jobs whose lease ran out (worker killed, host gone) go back to the queue, or fail past max_attempts."""
    with read(engine) as conn:
        expired = conn.execute(select(jobs.c.id, jobs.c.claim).where(
            jobs.c.state == RUNNING, jobs.c.lease_expires_at < db_now())).all()
    out = []
    error = error_record(Failure.INFRASTRUCTURE, "LeaseExpired",
                         "the worker stopped renewing its lease (killed, hung or disconnected)")
    for job_id, claim_no in expired:
        with write(engine) as conn:
            row = conn.execute(select(jobs.c.attempt, jobs.c.max_attempts, jobs.c.errors).where(
                _fenced(job_id, claim_no), jobs.c.lease_expires_at < db_now()).with_for_update()).first()
            if row is not None:
                out.append((job_id, _fail_row(conn, job_id, claim_no, row, error)))
    return out
