"""Deleting jobs and sweeps: their rows, then their stored objects (DELETE /jobs/{id}, DELETE /sweeps/{id}).

A job's rows are its jobs row, its metrics and its job_deps rows (those go by their foreign key's cascade; rows of
other jobs naming it as after_id stay, as app/fleet/dependencies.py wants). Nothing else keeps a row per job: a worker's
row names its current job only while it runs it, and the Prometheus counters never go down, so they stay. Its objects
are every key under its folders of the data directory's layout (app/core/layout.py): artifacts/<id>/ (each run's
model or result, and the exports made of it), checkpoints/<id>/, logs/<id>.log, scratch/<id>/ and tensorboard/<id>/
(its event files), in the store (the data directory, or the bucket and this host's cache of it: app/core/storage.py).

A delete is one transaction: the reference checks (app/lifecycle/references.py) and the guarded DELETE (not queued or
running, not pinned) see the same rows, so a job claimed, retried or pinned meanwhile is refused, not deleted.
The objects go after the commit: a crash between the two leaves orphan objects of ids that no longer exist,
which answer nothing (every read starts at the row) and which a coming collector removes. Other hosts' caches
of a bucket keep their copies until then too.

A worker still running a job deleted under it (a lease that ran out, a race) is fenced like one whose job was
cancelled: every write it makes is guarded by its claim on a row that is gone, so each matches nothing and
nothing is created again (app/jobs/queue.py inserts metrics only after its fenced read found the row); its
supervisor sees the fence fail, stops the job process and, seeing the row gone (`gone`), deletes what the
run left behind (worker/supervisor/launch.py).
"""
import logging

from sqlalchemy import delete, false, func, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

from trainyard.app.core.errors import Conflict, NotFound
from trainyard.app.core.states import SweepState
from trainyard.app.core.storage import Store
from trainyard.app.db import jobs, metrics, read, sweep_log, sweeps, write
from trainyard.app.lifecycle import references
from trainyard.app.records import Job, sweep_reads
from trainyard.app.records.sweep_results import best_trial

log = logging.getLogger("trainyard.deletion")
CHUNK = 500  # ids per IN (...): far below both databases' limits on bound parameters


def delete_job(engine: Engine, store: Store, job_id: int) -> None:
    """Delete the job's rows and objects; NotFound if there is none, Conflict naming what keeps it."""
    with write(engine) as conn:
        if not lock(conn, [job_id]):
            raise NotFound(f"job {job_id} not found")
        why = references.why_kept(conn, job_id)
        if why:
            raise Conflict(why)
        delete_rows(conn, [job_id])
    delete_objects(store, [job_id])


def delete_sweep(engine: Engine, store: Store, sweep_id: int, keep_best: bool = False) -> int | None:
    """Delete an ended sweep, its study's journal and its trials (their rows and objects), all or none: a trial
    something keeps (pinned, named by a job that has not ended) makes it a Conflict naming that. With keep_best,
    the best trial's job stays, detached from the sweep (sweep_id NULL; its `sweep` record, which trial it was
    and the values it tried, stays as its history). Returns the job kept, or None."""
    with write(engine) as conn:
        row = conn.execute(select(sweeps.c.id, sweeps.c.state, sweeps.c.spec["metric"].as_string().label("metric"),
                                  sweeps.c.spec["direction"].as_string().label("direction"))
                           .where(sweeps.c.id == sweep_id).with_for_update()).first()
        if row is None:
            raise NotFound(f"sweep {sweep_id} not found")
        if row.state == SweepState.RUNNING:
            raise Conflict(f"sweep {sweep_id} is running; cancel it first (POST /sweeps/{sweep_id}/cancel)")
        why = references.why_sweep_kept(conn, sweep_id)
        if why:
            raise Conflict(f"sweep {sweep_id} is not deleted: {why}")
        trials = sweep_reads.trials_in(conn, [sweep_id])[sweep_id]
        best = best_trial({"metric": row.metric, "direction": row.direction}, trials) if keep_best else None
        doomed = [t.id for t in trials if best is None or t.id != best.id]
        lock(conn, doomed)
        why = references.why_any_kept(conn, doomed)
        if why:
            raise Conflict(f"sweep {sweep_id} is not deleted: {why}")
        delete_rows(conn, doomed)
        if best is not None:
            conn.execute(update(jobs).where(jobs.c.id == best.id).values(sweep_id=None))
        conn.execute(delete(sweep_log).where(sweep_log.c.sweep_id == sweep_id))
        conn.execute(delete(sweeps).where(sweeps.c.id == sweep_id))
    delete_objects(store, doomed)
    return best.id if best is not None else None


def lock(conn: Connection, job_ids: list[int]) -> list[int]:
    """Lock the jobs' rows for the transaction (PostgreSQL; SQLite's BEGIN IMMEDIATE holds every row): a retry
    or claim of one waits for the delete, then finds it gone. The ids found."""
    found: list[int] = []
    for i in range(0, len(job_ids), CHUNK):
        found += conn.execute(select(jobs.c.id).where(jobs.c.id.in_(job_ids[i:i + CHUNK]))
                              .with_for_update()).scalars()
    return found


def delete_unkept(engine: Engine, job_ids: list[int]) -> list[int]:
    """Delete the rows of those of the jobs that nothing keeps (retention's rule: app/lifecycle/retention.py) and return
    their ids; their objects are left to the collector, which finds them unreferenced."""
    with write(engine) as conn:
        doomed = [i for i in lock(conn, job_ids) if references.why_kept(conn, i) is None]
        delete_rows(conn, doomed)
    return doomed


def delete_rows(conn: Connection, job_ids: list[int], guarded: bool = True) -> None:
    """Delete the jobs' metrics and rows in the caller's transaction, guarded (unless told not to: the tests'
    stand-in for a lease that ran out under a delete) against a job queued, running or pinned meanwhile."""
    for i in range(0, len(job_ids), CHUNK):
        ids = job_ids[i:i + CHUNK]
        conn.execute(delete(metrics).where(metrics.c.job_id.in_(ids)))
        where: list[ColumnElement[bool]] = [jobs.c.id.in_(ids)]
        if guarded:
            where += [jobs.c.state.not_in(references.ACTIVE), func.coalesce(jobs.c.pinned, false()) == false()]
        gone = conn.execute(delete(jobs).where(*where)).rowcount
        if gone != len(ids):  # every reference was checked under the same locks: only a bug gets here
            raise Conflict(f"jobs {ids} changed while being deleted; try again")


def delete_objects(store: Store, job_ids: list[int]) -> None:
    """Every stored object of the jobs (their rows already gone). A store that fails leaves orphans (logged),
    not an error: the jobs are gone either way, and a retried DELETE would only answer 404."""
    layout = store.layout
    for job_id in job_ids:
        folders = (layout.run_dir(job_id, 0).parent, layout.checkpoints(job_id), layout.scratch(job_id),
                   layout.tensorboard(job_id))
        try:
            for folder in folders:
                store.delete_prefix(layout.rel(folder))
            store.delete(layout.rel(layout.log(job_id)))
        except Exception as exc:
            log.warning("job %s: objects left in %s (a collector removes them): %s", job_id, store.describe(), exc)


def gone(engine: Engine, job_id: int) -> bool:
    """Whether the job's row is gone (deleted: a worker fenced out of it cleans up after its run)."""
    with read(engine) as conn:
        return conn.execute(select(jobs.c.id).where(jobs.c.id == job_id)).first() is None


def pin(engine: Engine, job_id: int, pinned: bool = True) -> Job:
    """Pin (or unpin) the job: a pinned job is kept from deletion, in whatever state. The job as it is now."""
    with write(engine) as conn:
        row = conn.execute(update(jobs).where(jobs.c.id == job_id).values(pinned=pinned).returning(jobs)).first()
    if row is None:
        raise NotFound(f"job {job_id} not found")
    return Job.from_row(row)
