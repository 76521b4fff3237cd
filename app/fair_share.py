"""Fair share between projects, and their limits on devices: which project's queued job a free device goes to.

The next claim goes to the project with the least recent device time for its share, as Slurm's fair-share does:
each project's device-seconds (a run's length times its devices), each weighed down by half every
TRAINYARD_FAIR_SHARE_HALF_LIFE_S since the run ended (a running job's count in full), divided by the project's
share (projects.share, 1 by default). Then priority, then age, within it (app/placement.py's head of the line).
A project alone on the fleet uses all of it; two projects with queued jobs each get devices in proportion to
their shares over time. Jobs of no project (the admin token's, or made before projects) are one more project,
of share 1.

The device time is read from the jobs' rows at each claim: every job that runs or ended within eight half-lives
(their weight past it is under 1/256). A job's earlier runs (before a retry or a requeue) are not in its row and
are not counted: a preempted job's project is under-counted by its lost run.

A project's `devices` limit (projects.limits) caps the devices its running jobs hold at once: its queued jobs
are not eligible while it is at the limit (`limited`), and wait saying so (`at_limit`).
"""
from typing import Any

from sqlalchemy import and_, case, func, literal, or_, select
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from trainyard.app.db import db_now, jobs, projects
from trainyard.app.records import Job
from trainyard.app.states import JobState

RUNNING = JobState.RUNNING.value
WINDOW = 8  # half-lives


def usage(conn: Connection, half_life_s: float) -> tuple[dict[int | None, float], float]:
    """Each project's decayed device-seconds (None: jobs of no project), and the database's now."""
    now = conn.execute(select(db_now())).scalar_one()
    rows = conn.execute(select(jobs.c.project_id, jobs.c.devices, jobs.c.started_at, jobs.c.finished_at,
                               jobs.c.state).where(
        jobs.c.started_at.is_not(None),
        or_(jobs.c.state == RUNNING, jobs.c.finished_at > now - WINDOW * half_life_s))).all()
    used: dict[int | None, float] = {}
    for r in rows:
        end = now if r.state == RUNNING or r.finished_at is None else r.finished_at
        seconds = max(0.0, end - r.started_at) * (r.devices or 1)
        used[r.project_id] = used.get(r.project_id, 0.0) + seconds * 0.5 ** (max(0.0, now - end) / half_life_s)
    return used, now


def rank(conn: Connection, half_life_s: float) -> ColumnElement[Any]:
    """An ORDER BY term for queued jobs: their project's decayed device time over its share, lowest first."""
    used, _ = usage(conn, half_life_s)
    shares = dict(conn.execute(select(projects.c.id, projects.c.share)).all())
    ranks = {p: seconds / max(shares.get(p, 1.0) or 1.0, 1e-9) for p, seconds in used.items() if p is not None}
    alone = used.get(None, 0.0)
    if not ranks:
        return literal(0.0)
    return case(ranks, value=jobs.c.project_id, else_=case((jobs.c.project_id.is_(None), alone), else_=0.0))


def limited() -> ColumnElement[bool]:
    """The job's project may start it now: no `devices` limit, or its running jobs and this one within it."""
    other = jobs.alias("project_running")
    cap = select(projects.c.limits["devices"].as_integer()).where(projects.c.id == jobs.c.project_id) \
        .scalar_subquery()
    held = select(func.coalesce(func.sum(func.coalesce(other.c.devices, 1)), 0)).where(
        other.c.state == RUNNING, other.c.project_id == jobs.c.project_id).scalar_subquery()
    return or_(jobs.c.project_id.is_(None), cap.is_(None), held + func.coalesce(jobs.c.devices, 1) <= cap)


def at_limit(conn: Connection, queued: list[Job]) -> dict[int, str]:
    """Why each of these queued jobs waits for its project's `devices` limit (only those that do)."""
    wanted = {j.project_id for j in queued if j.project_id is not None}
    if not wanted:
        return {}
    caps = {r.id: (r.name, (r.limits or {}).get("devices")) for r in conn.execute(
        select(projects.c.id, projects.c.name, projects.c.limits).where(projects.c.id.in_(wanted)))}
    held = dict(conn.execute(select(jobs.c.project_id, func.sum(func.coalesce(jobs.c.devices, 1))).where(
        and_(jobs.c.state == RUNNING, jobs.c.project_id.in_(wanted))).group_by(jobs.c.project_id)).all())
    out = {}
    for j in queued:
        name, cap = caps.get(j.project_id, (None, None)) if j.project_id is not None else (None, None)
        if cap is not None and (held.get(j.project_id) or 0) + (j.devices or 1) > cap:
            out[j.id] = (f"project {name} is at its limit of {cap} device{'s' if cap != 1 else ''} in use at once "
                         f"({held.get(j.project_id) or 0} held by its running jobs)")
    return out
