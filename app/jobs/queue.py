"""The queue: the only code that changes a job's state.

Every transition is one guarded UPDATE. Writes a worker makes about a job are fenced by the claim number it got
when it claimed the job (`WHERE id = ? AND claim = ? AND state = 'running'`): a worker that lost its lease (paused,
partitioned, too slow) changes nothing. Times come from the database's clock (db.db_now) so that hosts with skewed
clocks agree on leases. Jobs enter through app/jobs/submit.py (the INSERT), are read through app/records/job_reads.py.
"""
from collections.abc import Callable
from typing import Any

from sqlalchemy import ColumnElement, and_, case, delete, func, insert, select, update
from sqlalchemy.engine import Connection, Engine, Row

from trainyard.app.accounts import Principal, quotas
from trainyard.app.core.errors import Conflict, NotFound
from trainyard.app.core.states import RETRYABLE, ErrorRecord, Failure, JobState, error_record
from trainyard.app.db import counting, db_now, jobs, metrics, read, wakeup, workers, write
from trainyard.app.fleet import idle_look, placement
from trainyard.app.jobs import tracked
from trainyard.app.records import Job

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, PRUNED = (s.value for s in JobState)


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


def stop(engine: Engine, job_ids: list[int], error: ErrorRecord, states: tuple[str, ...] = (QUEUED, RUNNING),
         final: str = CANCELLED) -> list[int]:
    """End each job still in one of `states` with `error` (a sweep cancelling its trials, pruning one):
    one guarded UPDATE per job, so a job that has just ended keeps its own ending. The jobs' workers see
    their fence fail and stop the processes (within FENCE_CHECK_S plus the kill grace); the metrics
    recorded so far stay. Returns the ids it ended."""
    with write(engine) as conn:
        rows = conn.execute(select(jobs.c.id, jobs.c.state, jobs.c.errors, jobs.c.attempt)
                            .where(jobs.c.id.in_(job_ids), jobs.c.state.in_(states))
                            .order_by(jobs.c.id).with_for_update()).all()  # before any counter: app/db/counting.py
        ended = [row.id for row in rows if _end(conn, row, final, error) is not None]
        if ended:
            wakeup.notify(conn)
    return ended


def prune(engine: Engine, job_id: int, why: Callable[[int], ErrorRecord]) -> int | None:
    """End a running trial as pruned at the epoch it has reached (error: why(epoch)) unless that is its last (it is
    saving its model); its worker is fenced out, so its metrics end there. The epoch, or None if not pruned."""
    with write(engine) as conn:
        row = conn.execute(select(jobs.c.id, jobs.c.state, jobs.c.errors, jobs.c.attempt, jobs.c.epoch).where(
            jobs.c.id == job_id, jobs.c.state == RUNNING, jobs.c.epoch.is_not(None), jobs.c.epochs > jobs.c.epoch)
            .with_for_update()).first()
        if row is None or _end(conn, row, PRUNED, why(row.epoch)) is None:
            return None
        wakeup.notify(conn)
    return row.epoch


def _end(conn: Connection, row: Row, final: str, error: ErrorRecord) -> Row | None:
    """End a job in row.state (guarded by it) as `final`, `error` added to its history; the new row (None: moved)."""
    new = conn.execute(
        update(jobs).where(jobs.c.id == row.id, jobs.c.state == row.state)
        .values(state=final, finished_at=db_now(), lease_expires_at=None, error=error,
                errors=[*(row.errors or []), {**error, "attempt": row.attempt}])
        .returning(jobs)).first()
    counting.add(conn, counting.ended(row.state, new))
    return new


def retry(engine: Engine, job_id: int, who: Principal | None = None) -> Job:
    """Requeue a failed, cancelled or pruned job under the same id; it resumes from its last checkpoint (a pruned
    trial runs to its end, outside its sweep's search; a tracked job in a new MLflow run). A submit again: held to
    who's project's limits (queued_jobs, max_priority at the job's priority, stored_bytes; who None: none)."""
    with write(engine) as conn:
        held = quotas.hold(conn, who)  # before the job's row: the order every submit locks in
        # FOR UPDATE, as cancel's: two retries of one job take turns, and the second sees the first's QUEUED.
        row = conn.execute(select(jobs.c.state, jobs.c.priority).where(jobs.c.id == job_id).with_for_update()).first()
        if row is None:
            raise NotFound(f"job {job_id} not found")
        if row.state not in (FAILED, CANCELLED, PRUNED):
            raise Conflict(f"job {job_id} is {row.state}; only failed, cancelled or pruned jobs can be retried")
        quotas.admit(conn, held, [row.priority], by="retry")
        new = conn.execute(update(jobs).where(jobs.c.id == job_id).values(
            state=QUEUED, attempt=0, finished_at=None, error=None, worker_id=None, lease_expires_at=None,
            result=None, queued_at=db_now()).returning(jobs)).one()
        tracked.wake(conn, job_id)
        counting.add(conn, counting.requeued(counting.Trigger.REQUEST))
        wakeup.notify(conn)
    return Job.from_row(new)


# ---- the worker's side ------------------------------------------------------------------------

def has_work(engine: Engine, device: str, plugins: dict[str, list[str]] | None = None,
             worker_id: str | None = None, slot: placement.Slot | None = None, lease_s: float = 30.0,
             look: idle_look.Look | None = None, woken: bool = True) -> bool:
    """A cheap read (no SQLite write lock); with the worker's `look`, one statement when nothing changed since
    its last look found nothing (app/fleet/idle_look.py)."""
    return idle_look.has_work(engine, device, plugins, worker_id, slot, lease_s, look, woken)


# The PostgreSQL advisory lock claims take turns on (any constant; this one spells "tyclaim" in ASCII).
CLAIM_LOCK = 0x7479636C61696D


def claim(engine: Engine, worker_id: str, device: str, lease_s: float,
          plugins: dict[str, list[str]] | None = None, slot: placement.Slot | None = None,
          port: int = 0, look: idle_look.Look | None = None) -> Job | None:
    """Atomically take the next queued job this worker can run: highest priority first, then oldest.

    Claims take turns: BEGIN IMMEDIATE on SQLite, a transaction-scoped advisory lock on PostgreSQL.
    So no two workers get one job, two workers sharing a device cannot both count the same free
    memory, a worker cannot lend its device to another's multi-device job while claiming a job of its
    own, and no worker looks past a head of the line that another is looking at (row locks with SKIP
    LOCKED alone let a worker skip a multi-device head that another worker was finding it could not
    start yet, and overtake it). A claim takes a few milliseconds. port: free on this host (first_rank).
    look: the worker's, whose has_work began this claim cycle: its fair-share reading is used again."""
    memo = look.claiming() if look is not None else None
    with write(engine) as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(select(func.pg_advisory_xact_lock(CLAIM_LOCK)))
        found = placement.startable(conn, device, plugins, worker_id, slot, lease_s, lock=True, memo=memo)
        if found is None:
            return None
        job_id, others = found
        ranks = [placement.first_rank(conn, worker_id, device, slot, port, others), *others] if others else None
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
            if "addr" in others[0]:
                wakeup.notify(conn)  # the lent workers of other hosts start their ranks (worker/supervisor/part.py)
        # Epochs after the last checkpoint run again: drop their records (no gap nor duplicate in the history).
        conn.execute(delete(metrics).where(metrics.c.job_id == row.id,
                                           metrics.c.epoch > (row.checkpoint_epoch or 0)))
    return Job.from_row(row)


def _fenced(job_id: int, claim_no: int) -> ColumnElement[bool]:
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
        # FOR UPDATE: on PostgreSQL a job ended meanwhile (cancelled, pruned) gets no epoch past its end.
        row = conn.execute(select(jobs.c.attempt, jobs.c.peak_memory_allocated, jobs.c.peak_memory_reserved)
                           .where(_fenced(job_id, claim_no)).with_for_update()).first()
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


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def succeed(engine: Engine, job_id: int, claim_no: int, result: dict, artifact_path: str | None) -> bool:
    with write(engine) as conn:
        new = conn.execute(update(jobs).where(_fenced(job_id, claim_no)).values(
            state=SUCCEEDED, finished_at=db_now(), lease_expires_at=None, result=result,
            artifact_path=artifact_path, error=None,
            peak_memory_allocated=func.coalesce(result.get("peak_memory_allocated"), jobs.c.peak_memory_allocated),
            peak_memory_reserved=func.coalesce(result.get("peak_memory_reserved"), jobs.c.peak_memory_reserved))
            .returning(*counting.ENDED)).first()
        counting.add(conn, counting.ended(RUNNING, new))
        wakeup.notify(conn)  # its device is free: a job waiting for room may start
    return new is not None


def fail(engine: Engine, job_id: int, claim_no: int, error: ErrorRecord) -> str | None:
    """Record a failed run: retryable classes go back to the queue while attempts remain. The new state, or None
    if the job was no longer ours."""
    with write(engine) as conn:
        row = conn.execute(select(jobs.c.attempt, jobs.c.max_attempts, jobs.c.errors)
                           .where(_fenced(job_id, claim_no)).with_for_update()).first()
        if row is None:
            return None
        return _fail_row(conn, job_id, claim_no, row, error)


def _fail_row(conn: Connection, job_id: int, claim_no: int, row: Row, error: ErrorRecord) -> str:
    retry_it = error["class"] in RETRYABLE and row.attempt < row.max_attempts
    if error["class"] in RETRYABLE and not retry_it:
        error = {**error, "message": f"{error['message']} (gave up after {row.attempt} attempts)"}
    history = [*(row.errors or []), {**error, "attempt": row.attempt}]
    ends = dict(state=QUEUED, worker_id=None, queued_at=db_now()) if retry_it else dict(state=FAILED,
                                                                                         finished_at=db_now())
    values: dict[str, Any] = dict(error=error, errors=history, lease_expires_at=None, **ends)
    new = conn.execute(update(jobs).where(_fenced(job_id, claim_no)).values(values).returning(*counting.ENDED)).first()
    counting.add(conn, counting.requeued(counting.Trigger.FAILURE, error) if retry_it else counting.ended(RUNNING, new))
    wakeup.notify(conn)  # queued again, or ended: either gives some worker something to do
    return values["state"]


def requeue_preempted(engine: Engine, job_id: int, claim_no: int) -> bool:
    """The worker is shutting down, or the scheduler wants the device: the job goes back without using an attempt."""
    with write(engine) as conn:
        res = conn.execute(update(jobs).where(_fenced(job_id, claim_no)).values(
            preempt_requested_at=None, state=QUEUED, attempt=jobs.c.attempt - 1, worker_id=None,
            lease_expires_at=None, queued_at=db_now()))
        counting.add(conn, counting.preempted() if res.rowcount == 1 else {})
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
                counting.add(conn, counting.lease_expired())
    return out
