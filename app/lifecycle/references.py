"""What keeps a job or an uploaded dataset from being deleted: the one place that knows who refers to whom.

A job is kept while it is queued or running, while it is pinned (POST /jobs/{id}/pin: its model is in use
outside trainyard), while a job that has not ended names it (a predict job's `model_job`, a train job's
`init_from`, a job's `after`), and while it is the best trial of a sweep that still runs. A sweep is kept while it
runs, or while a job waits to be given its best trial. An uploaded dataset is
kept while a queued or running job trains or predicts on it. Each answer is the 409's text, naming the
reference, or None.

The reads are bounded by the jobs that have not ended (a fleet's worth): only their ids, states and the few
spec fields that name others are read (by JSON path, not their whole specs); jobs that have ended are never
scanned. app/lifecycle/deletion.py calls these inside the transaction that deletes, so what they saw is what the
guarded DELETE acts on.
"""
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from trainyard.app.core.states import JobState, SweepState
from trainyard.app.db import job_sweeps, jobs, sweeps
from trainyard.app.records import sweep_reads
from trainyard.app.records.sweep_results import best_trial
from trainyard.app.spec.common import UPLOAD_PREFIX

ACTIVE = (JobState.QUEUED.value, JobState.RUNNING.value)
# The spec fields by which a job names another job (`after`: the jobs it waits for, a list), read as JSON: a value
# that is no id (model_job "sweep:<id>:best" until its sweep ends) is passed over here, not cast by the database.
NAMING = {"model_job": jobs.c.spec["model_job"], "init_from": jobs.c.spec["init_from"]}
AFTER = jobs.c.spec["after"]
DATASET = jobs.c.spec[("data", "dataset")].as_string()


def why_kept(conn: Connection, job_id: int) -> str | None:
    """Why job_id may not be deleted now, or None (also for a job that does not exist: the caller says 404)."""
    return why_any_kept(conn, [job_id])


def why_any_kept(conn: Connection, job_ids: Iterable[int]) -> str | None:
    """Why one of job_ids may not be deleted now (the first reason found), or None: the jobs are read once,
    the jobs that have not ended once, and each running sweep among theirs once."""
    wanted = sorted(set(job_ids))
    rows: list[Any] = []
    for i in range(0, len(wanted), 500):
        rows += conn.execute(select(jobs.c.id, jobs.c.state, jobs.c.pinned, jobs.c.sweep_id)
                             .where(jobs.c.id.in_(wanted[i:i + 500])).order_by(jobs.c.id)).all()
    for row in rows:
        if row.state in ACTIVE:
            return f"job {row.id} is {row.state}; cancel it first"
        if row.pinned:
            return f"job {row.id} is pinned; unpin it first (POST /jobs/{row.id}/unpin)"
    found = {row.id for row in rows}
    for other, state, field in _namers(conn):
        for named in (set(field[1]) if field[0] == "after" else {field[1]}) & found - {other}:
            return f"job {named} is the {field[0]} of job {other}, which is {state}"
    best = _running_sweeps_best(conn, {row.sweep_id for row in rows
                                       if row.sweep_id is not None and row.state == JobState.SUCCEEDED})
    for row in rows:
        if row.sweep_id is not None and best.get(row.sweep_id) == row.id:
            return f"job {row.id} is the best trial of sweep {row.sweep_id}, which is running; cancel it first"
    return None


def _namers(conn: Connection) -> Iterable[tuple[int, str, tuple[str, Any]]]:
    """(job, its state, (field, the id or ids it names)) for every job that has not ended and names others."""
    rows = conn.execute(select(jobs.c.id, jobs.c.state, *(c.label(n) for n, c in NAMING.items()),
                               AFTER.label("after")).where(jobs.c.state.in_(ACTIVE)))
    for row in rows:
        for name in NAMING:
            if _is_id(getattr(row, name)):
                yield row.id, row.state, (name, getattr(row, name))
        after = row.after
        if isinstance(after, list):
            yield row.id, row.state, ("after", [a for a in after if _is_id(a)])


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _running_sweeps_best(conn: Connection, sweep_ids: set[int]) -> dict[int, int]:
    """The best trial's job of each of sweep_ids that is running (read without their specs)."""
    if not sweep_ids:
        return {}
    running = conn.execute(select(sweeps.c.id, sweeps.c.spec["metric"].as_string().label("metric"),
                                  sweeps.c.spec["direction"].as_string().label("direction"))
                           .where(sweeps.c.id.in_(sorted(sweep_ids)), sweeps.c.state == SweepState.RUNNING)).all()
    out = {}
    trials = sweep_reads.trials_in(conn, [sweep.id for sweep in running])
    for sweep in running:
        best = best_trial({"metric": sweep.metric, "direction": sweep.direction}, trials[sweep.id])
        if best is not None:
            out[sweep.id] = best.id
    return out


def why_sweep_kept(conn: Connection, sweep_id: int) -> str | None:
    """Why the (ended) sweep may not be deleted now, its trials aside: a job still waits to be given its best trial
    ("sweep:<id>:best", resolved once it has ended: app/fleet/dependencies.py), or None."""
    waiting = conn.execute(select(job_sweeps.c.job_id, job_sweeps.c.field).where(job_sweeps.c.sweep_id == sweep_id)
                           .order_by(job_sweeps.c.job_id).limit(1)).first()
    if waiting is None:
        return None
    return f"job {waiting.job_id} waits for the best trial of sweep {sweep_id} (its {waiting.field}); try again shortly"


def why_dataset_kept(conn: Connection, upload_id: str) -> str | None:
    """Why the uploaded dataset may not be deleted now (a queued or running job uses it), or None."""
    user = conn.execute(select(jobs.c.id, jobs.c.state).where(
        jobs.c.state.in_(ACTIVE), DATASET == f"{UPLOAD_PREFIX}{upload_id}").order_by(jobs.c.id).limit(1)).first()
    if user is None:
        return None
    return f"dataset {upload_id} is used by job {user.id}, which is {user.state}; cancel it or wait for it to end"
