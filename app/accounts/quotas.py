"""A project's limits checked at submit: how many jobs it may hold queued, the highest priority its members may
ask for, how many sweeps it may have running, how many bytes it may store. A submit past one is refused, naming
the limit; nothing is made.

- `queued_jobs` (Conflict, 409): POST /jobs, POST /jobs/batch (each job of it) and POST /jobs/{id}/retry while
  the project holds that many queued jobs (those waiting for jobs they name included). A sweep's trials are not
  counted or held back: its driver makes them over time, one by one, as the sweep goes. A requeue the service
  makes (a preempted job, a lost worker's) is not a submit.
- `max_priority` (Invalid, 422, naming `priority`): a job's, each job of a batch's, a retried job's own, and
  every priority a sweep's trials may run at (its job's, or each a `priority` parameter may take), above it.
  Unset, a member may ask for MEMBER_PRIORITY at most: priority decides the claim and the preemption between a
  project's jobs, so one member cannot jump or stop a teammate's work unless an admin lets them.
- `running_sweeps` (409): POST /sweeps while the project has that many sweeps running.
- `stored_bytes` (409): a job's, a batch's, a retry's, a sweep's submit and an upload while the project's stored
  bytes, as the collector last measured them (project_usage: app/lifecycle/project_storage.py), are at or over the
  limit.
  The measure lags by up to a collector pass (TRAINYARD_COLLECT_S): a project may pass its limit by what it
  stores between.

The jobs' limits are checked inside the transaction that inserts (or requeues) them, once it holds the project:
hold() locks the project's row (PostgreSQL: FOR UPDATE; SQLite's BEGIN IMMEDIATE holds the whole database), so
the submits of one project take turns from there to their commit, and each counts the jobs the one before it
queued: no number of submits at once passes `queued_jobs`. hold() comes before any job row is touched, so every
writer takes the locks in one order (project, then jobs) and none waits on another in a circle. `running_sweeps`
is read before the sweep's insert: sweeps submitted at the same instant may pass it by those few.

The limits on what runs at once (devices, GPU memory) are kept at the claim instead (app/fleet/fair_share.py): past
them a job waits. Admins, and requests acting in no project, are never limited.
"""
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection, Engine

from trainyard.app.accounts import Principal, project_limits
from trainyard.app.core.errors import Conflict, Invalid
from trainyard.app.core.states import JobState, SweepState
from trainyard.app.db import jobs, project_usage, projects, read, sweeps

ASK = "or ask an admin"
# The highest priority a member may ask for in a project whose limits set no max_priority: the default job's.
MEMBER_PRIORITY = 0


@dataclass(frozen=True)
class Held:
    """A project whose limits hold who submits, its row locked until the transaction that holds it ends."""
    project_id: int
    name: str
    limits: dict[str, Any]


def hold(conn: Connection, who: Principal | None) -> Held | None:
    """In a write transaction about to queue jobs for who: who's project, locked (see the module's docstring);
    None when nothing limits who (an admin, no project)."""
    return _project(conn, who, lock=True)


def admit(conn: Connection, held: Held | None, priorities: list[int], by: str = "job") -> None:
    """Refuse jobs of these priorities past the held project's max_priority (Invalid), queued_jobs or stored_bytes
    (Conflict). Call it after hold(), in the same transaction, before the jobs are queued. by: "job" (the body's
    priority is at fault), "batch" (each job's, named by its place) or "retry" (no body: the message names it)."""
    if held is None:
        return
    for i, priority in enumerate(priorities):
        _priority(held, priority, {"job": ("priority",), "batch": (i, "priority")}.get(by))
    cap = held.limits.get("queued_jobs")
    if cap is not None:
        queued = _count(conn, jobs, jobs.c.state == JobState.QUEUED.value, held.project_id)
        if queued + len(priorities) > cap:
            raise Conflict(_queued(held.name, queued, cap, len(priorities)))
    _storage(conn, held)


def check_sweep(engine: Engine, who: Principal | None,
                priority: tuple[float, tuple[str, ...]] | None = None) -> None:
    """Refuse a sweep of who's project past its running_sweeps or stored_bytes limit (Conflict), or whose trials
    may run at a priority past its max_priority (priority: the highest, and the field that sets it)."""
    with read(engine) as conn:
        held = _project(conn, who)
        if held is None:
            return
        if priority is not None:
            _priority(held, *priority)
        cap = held.limits.get("running_sweeps")
        if cap is not None:
            running = _count(conn, sweeps, sweeps.c.state == SweepState.RUNNING.value, held.project_id)
            if running >= cap:
                raise Conflict(f"project {held.name} has {running} running sweep{'s' if running != 1 else ''}, "
                               f"its limit of {cap} (running_sweeps); wait for one to end, cancel one, {ASK}")
        _storage(conn, held)


def check_storage(engine: Engine, who: Principal | None) -> None:
    """Refuse to store more for who's project (an upload) once its stored bytes are at or over stored_bytes."""
    with read(engine) as conn:
        held = _project(conn, who)
        if held is not None:
            _storage(conn, held)


def _project(conn: Connection, who: Principal | None, lock: bool = False) -> Held | None:
    """who's project and its limits as app/accounts/project_limits.py bounds them (one stored before the bounds never
    reaches SQL), its row locked for the transaction if asked; None when nothing limits who."""
    if who is None or who.admin or who.project_id is None:
        return None
    q = select(projects.c.name, projects.c.share, projects.c.limits).where(projects.c.id == who.project_id)
    row = conn.execute(q.with_for_update() if lock else q).first()
    if row is None:
        return None
    bounded = project_limits.bounded(who.project_id, row.name, row.share, row.limits)
    return Held(who.project_id, row.name, bounded.limits)


def _priority(held: Held, priority: float, at: tuple | None) -> None:
    cap = held.limits.get("max_priority")
    if not isinstance(cap, int | float) or isinstance(cap, bool) or cap != cap:  # stored around the API: unset
        cap = None
    highest = MEMBER_PRIORITY if cap is None else cap
    if priority > highest:
        limit = (f"its limit of {cap} (max_priority)" if cap is not None
                 else f"{MEMBER_PRIORITY}, the default when it sets no max_priority")
        shown = str(priority) if isinstance(priority, int) else f"{priority:g}"  # a sweep's choice: any size
        raise Invalid(f"priority {shown[:30]} is over what project {held.name}'s members may ask for: {limit}; "
                      f"ask for at most {highest}, {ASK} to raise its max_priority", loc=at)


def _count(conn: Connection, table, condition, project_id: int) -> int:
    return int(conn.execute(select(func.count()).select_from(table).where(
        condition, table.c.project_id == project_id)).scalar_one())


def _queued(name: str, held: int, cap: int, adding: int) -> str:
    if held >= cap:
        limit = "its limit" if held == cap else f"over its limit of {cap}"
        return (f"project {name} holds {held} queued job{'s' if held != 1 else ''}, {limit} (queued_jobs); "
                f"wait for some to start, {ASK}")
    return (f"project {name} holds {held} queued job{'s' if held != 1 else ''}: these {adding} would pass its "
            f"limit of {cap} (queued_jobs); submit at most {cap - held}, wait for some to start, {ASK}")


def _storage(conn: Connection, held: Held) -> None:
    cap = held.limits.get("stored_bytes")
    if cap is None:
        return
    stored = conn.execute(select(project_usage.c.bytes).where(project_usage.c.project_id == held.project_id)
                          ).scalar() or 0
    if stored >= cap:
        raise Conflict(f"project {held.name} stores {_size(stored)} as last measured, at or over its limit of "
                       f"{_size(cap)} (stored_bytes); delete jobs, sweeps or datasets it no longer needs (the "
                       f"collector measures again at its next pass), {ASK}")


def _size(n: int) -> str:
    return f"{n:,} bytes" if n < 10**6 else f"{n / 1e9:,.2f} GB ({n:,} bytes)"
