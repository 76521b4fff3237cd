"""A project's limits checked at submit: how many jobs it may hold queued, how many sweeps it may have running,
how many bytes it may store. A submit past one is refused (Conflict, 409) naming the limit; nothing is made.

- `queued_jobs`: POST /jobs and POST /jobs/batch (each job of it) while the project holds that many queued jobs
  (those waiting for jobs they name included). A sweep's trials are not counted or held back: its driver makes
  them over time, one by one, as the sweep goes; a retry or a requeue is not a submit either.
- `running_sweeps`: POST /sweeps while the project has that many sweeps running.
- `stored_bytes`: a job's, a batch's, a sweep's submit and an upload while the project's stored bytes, as the
  collector last measured them (project_usage: app/project_storage.py), are at or over the limit. The measure
  lags by up to a collector pass (TRAINYARD_COLLECT_S): a project may pass its limit by what it stores between.

The limits on what runs at once (devices, GPU memory) are kept at the claim instead (app/fair_share.py): past
them a job waits. Admins, and requests acting in no project, are never limited. The counts are read before the
insert, not in its transaction: submits of one project made at the same instant may pass a limit by those few.
"""
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection, Engine

from trainyard.app.accounts import Principal
from trainyard.app.db import jobs, project_usage, projects, read, sweeps
from trainyard.app.errors import Conflict
from trainyard.app.states import JobState, SweepState

ASK = "or ask an admin"


def check_submit(engine: Engine, who: Principal | None, adding_jobs: int) -> None:
    """Refuse `adding_jobs` more queued jobs of who's project past its queued_jobs or stored_bytes limit."""
    with read(engine) as conn:
        project = _project(conn, who)
        if project is None:
            return
        name, limits = project
        cap = limits.get("queued_jobs")
        if cap is not None:
            held = _count(conn, jobs, jobs.c.state == JobState.QUEUED.value, who)
            if held + adding_jobs > cap:
                raise Conflict(_queued(name, held, cap, adding_jobs))
        _storage(conn, name, limits, who)


def check_sweep(engine: Engine, who: Principal | None) -> None:
    """Refuse a sweep of who's project past its running_sweeps or stored_bytes limit."""
    with read(engine) as conn:
        project = _project(conn, who)
        if project is None:
            return
        name, limits = project
        cap = limits.get("running_sweeps")
        if cap is not None:
            running = _count(conn, sweeps, sweeps.c.state == SweepState.RUNNING.value, who)
            if running >= cap:
                raise Conflict(f"project {name} has {running} running sweep{'s' if running != 1 else ''}, its limit "
                               f"of {cap} (running_sweeps); wait for one to end, cancel one, {ASK}")
        _storage(conn, name, limits, who)


def check_storage(engine: Engine, who: Principal | None) -> None:
    """Refuse to store more for who's project (an upload) once its stored bytes are at or over stored_bytes."""
    with read(engine) as conn:
        project = _project(conn, who)
        if project is not None:
            _storage(conn, *project, who)


def _project(conn: Connection, who: Principal | None) -> tuple[str, dict[str, Any]] | None:
    """who's project's name and limits; None when nothing limits who (an admin, no project, no limits)."""
    if who is None or who.admin or who.project_id is None:
        return None
    row = conn.execute(select(projects.c.name, projects.c.limits).where(projects.c.id == who.project_id)).first()
    return None if row is None or not row.limits else (row.name, row.limits)


def _count(conn: Connection, table, condition, who: Principal | None) -> int:
    assert who is not None
    return int(conn.execute(select(func.count()).select_from(table).where(
        condition, table.c.project_id == who.project_id)).scalar_one())


def _queued(name: str, held: int, cap: int, adding: int) -> str:
    if held >= cap:
        limit = "its limit" if held == cap else f"over its limit of {cap}"
        return (f"project {name} holds {held} queued job{'s' if held != 1 else ''}, {limit} (queued_jobs); "
                f"wait for some to start, {ASK}")
    return (f"project {name} holds {held} queued job{'s' if held != 1 else ''}: these {adding} would pass its "
            f"limit of {cap} (queued_jobs); submit at most {cap - held}, wait for some to start, {ASK}")


def _storage(conn: Connection, name: str, limits: dict[str, Any], who: Principal | None) -> None:
    cap = limits.get("stored_bytes")
    if cap is None or who is None:
        return
    stored = conn.execute(select(project_usage.c.bytes).where(project_usage.c.project_id == who.project_id)
                          ).scalar() or 0
    if stored >= cap:
        raise Conflict(f"project {name} stores {_size(stored)} as last measured, at or over its limit of "
                       f"{_size(cap)} (stored_bytes); delete jobs, sweeps or datasets it no longer needs (the "
                       f"collector measures again at its next pass), {ASK}")


def _size(n: int) -> str:
    return f"{n:,} bytes" if n < 10**6 else f"{n / 1e9:,.2f} GB ({n:,} bytes)"
