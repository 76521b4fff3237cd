"""Reading sweeps: one (with its spec, or its summary instead), a page of them, the running ones, their trial
jobs, and what the driver watches of them. Nothing here writes (app/sweeps/sweep_store.py does).

Given who asks (a Principal), a read sees only that principal's project's sweeps (admins: all): another
project's sweep is NotFound exactly as a missing one, and a page leaves it out of its rows and its count."""
from typing import Any

from sqlalchemy import and_, func, null, select, true, union_all
from sqlalchemy.engine import Connection, Engine

from trainyard.app.accounts import ROOT, Principal, project_rows
from trainyard.app.core.errors import NotFound
from trainyard.app.core.states import JobState, SweepState
from trainyard.app.db import jobs, read, sweeps, users
from trainyard.app.records import Job, Sweep, SweepPlan
from trainyard.app.records.sweep_results import goal, planned, summary

RUNNING = SweepState.RUNNING.value


def seen_by(who: Principal | None):
    """The sweeps `who` may see (None: the service itself, which sees all)."""
    found = project_rows(sweeps, who)
    return true() if found is None else found


def visible(engine: Engine, sweep_id: int, who: Principal | None) -> None:
    """NotFound unless the sweep exists and `who` may see it (the same answer for both)."""
    with read(engine) as conn:
        found = conn.execute(select(sweeps.c.id).where(sweeps.c.id == sweep_id, seen_by(who))).first()
    if found is None:
        raise NotFound(f"sweep {sweep_id} not found")


def owner_of(engine: Engine, sweep: Sweep) -> Principal:
    """Who the sweep acts as when its driver admits a trial: its owner in its project, an admin if the owner
    is one (or the sweep predates accounts). A user made after the sweep is not its owner, even by the same name:
    an owner deleted and the name given to a new admin leaves the sweep a member's."""
    admin = sweep.project_id is None or sweep.owner in (None, ROOT)
    if not admin:
        with read(engine) as conn:
            admin = bool(conn.execute(select(users.c.admin).where(
                users.c.name == sweep.owner, users.c.created_at <= sweep.created_at)).scalar())
    return Principal(sweep.owner or ROOT, admin, sweep.project_id)


def get(engine: Engine, sweep_id: int, who: Principal | None = None) -> Sweep:
    """The sweep with its spec (NotFound)."""
    with read(engine) as conn:
        row = conn.execute(select(sweeps).where(sweeps.c.id == sweep_id, seen_by(who))).first()
    if row is None:
        raise NotFound(f"sweep {sweep_id} not found")
    values = row._asdict()
    return Sweep.from_values(values, summary(values["spec"]))


# What a list item and an event stream show of a sweep's spec, read by the database from the stored JSON:
# the spec itself (up to the request body's size, mostly choice values) is never read whole for them.
_SUMMARY = {"method": sweeps.c.spec["method"].as_string(), "metric": sweeps.c.spec["metric"].as_string(),
            "direction": sweeps.c.spec["direction"].as_string(),
            "max_trials": sweeps.c.spec["max_trials"].as_integer(),
            "max_concurrent": sweeps.c.spec["max_concurrent"].as_integer()}
_SUMMARISED = select(*(c for c in sweeps.c if c.name != "spec"), *(v.label(k) for k, v in _SUMMARY.items()))
# A grid sweep without max_trials makes as many trials as its grid has combinations: counted once per
# sweep and process from its parameters (a stored spec never changes).
_grid_sizes: dict[int, int] = {}


def get_summary(engine: Engine, sweep_id: int, who: Principal | None = None) -> Sweep:
    """The sweep without its spec, with its summary (the spec's plan) (NotFound)."""
    found = _summarised(engine, _SUMMARISED.where(sweeps.c.id == sweep_id, seen_by(who)))
    if not found:
        raise NotFound(f"sweep {sweep_id} not found")
    return found[0]


def page(engine: Engine, state: SweepState | None = None, limit: int = 50, offset: int = 0,
         who: Principal | None = None) -> tuple[list[Sweep], int]:
    """A page of sweeps without their specs (each with its summary instead), newest first, and how many match."""
    where = and_(seen_by(who), *([sweeps.c.state == state.value] if state else []))
    with read(engine) as conn:
        total = conn.execute(select(func.count()).select_from(sweeps).where(where)).scalar_one()
    found = _summarised(engine, _SUMMARISED.where(where).order_by(sweeps.c.id.desc()).limit(limit).offset(offset))
    return found, total


def _summarised(engine: Engine, query) -> list[Sweep]:
    with read(engine) as conn:
        rows = [r._asdict() for r in conn.execute(query)]
    return [Sweep.from_values(r, _plan(engine, r)) for r in rows]


def _plan(engine: Engine, row: dict[str, Any]) -> SweepPlan:
    plan: dict[str, Any] = {k: row.pop(k) for k in _SUMMARY}
    sweep_id = row["id"]
    if plan["method"] == "grid" and plan["max_trials"] is None:
        if sweep_id not in _grid_sizes:
            if len(_grid_sizes) > 10_000:
                _grid_sizes.clear()
            _grid_sizes[sweep_id] = planned("grid", None, lambda: _parameters(engine, sweep_id))
        trials = _grid_sizes[sweep_id]
    else:
        trials = planned(plan["method"], plan["max_trials"], dict)
    return {"method": plan["method"], "metric": plan["metric"], "direction": goal(plan), "max_trials": trials,
            "max_concurrent": plan["max_concurrent"]}


def _parameters(engine: Engine, sweep_id: int) -> dict:
    with read(engine) as conn:
        return conn.execute(select(sweeps.c.spec["parameters"]).where(sweeps.c.id == sweep_id)).scalar_one()


def running(engine: Engine) -> list[int]:
    with read(engine) as conn:
        return list(conn.execute(select(sweeps.c.id).where(sweeps.c.state == RUNNING).order_by(sweeps.c.id)).scalars())


_LIGHT = [c for c in jobs.c if c.name not in ("spec", "errors")]


def trials(engine: Engine, sweep_ids: list[int]) -> dict[int, list[Job]]:
    """Each sweep's trial jobs by trial number (the heavy spec and errors left unread)."""
    if not sweep_ids:
        return {}
    with read(engine) as conn:
        return trials_in(conn, sweep_ids)


def trials_in(conn: Connection, sweep_ids: list[int]) -> dict[int, list[Job]]:
    """trials(), in the caller's transaction (a delete's, which must see what it deletes)."""
    out: dict[int, list[Job]] = {i: [] for i in sweep_ids}
    if not sweep_ids:
        return out
    rows = conn.execute(select(*_LIGHT).where(jobs.c.sweep_id.in_(sweep_ids)).order_by(jobs.c.id)).all()
    for row in rows:
        job = Job.from_row(row)
        if job.sweep_id is not None:
            out[job.sweep_id].append(job)
    for found in out.values():
        found.sort(key=lambda j: (j.sweep or {})["trial"])
    return out


def jobs_by_id(engine: Engine, job_ids: list[int]) -> dict[int, Job]:
    """Trial jobs by id, without their heavy spec and errors (the driver reads only its running trials')."""
    if not job_ids:
        return {}
    with read(engine) as conn:
        rows = conn.execute(select(*_LIGHT).where(jobs.c.id.in_(job_ids))).all()
    return {row.id: Job.from_row(row) for row in rows}


# What of a trial job the driver watches: a job claimed, requeued, retried, ended or deleted, or one that reports
# an epoch, changes one of these.
_WATCHED = (jobs.c.state, jobs.c.claim, jobs.c.attempt, jobs.c.epoch, jobs.c.finished_at)


def watch(engine: Engine, job_ids: list[int]) -> tuple[list[int], dict[int, tuple]]:
    """The running sweeps, and what the driver watches of the given trial jobs (its running trials'), in one
    query by index and primary key: its cost is the running sweeps and trials, not the trials made so far."""
    runs = select(sweeps.c.id, null(), *(null() for _ in _WATCHED)).where(sweeps.c.state == RUNNING)
    query = union_all(runs, select(jobs.c.sweep_id, jobs.c.id, *_WATCHED).where(jobs.c.id.in_(job_ids))) \
        if job_ids else runs
    running_ids, watched = [], {}
    with read(engine) as conn:
        for row in conn.execute(query):
            if row[1] is None:
                running_ids.append(row[0])
            else:
                watched[row[1]] = (row[0], *row[2:])
    return sorted(running_ids), watched


def active_trials(engine: Engine, sweep_id: int) -> list[int]:
    """The sweep's queued and running trial jobs."""
    with read(engine) as conn:
        return list(conn.execute(select(jobs.c.id).where(
            jobs.c.sweep_id == sweep_id, jobs.c.state.in_((JobState.QUEUED.value, JobState.RUNNING.value))))
            .scalars())
