"""Sweeps in the database: submit (validate, persist), read, cancel, and the fenced writes of the
process that advances a sweep (app/search.py owns the search itself).

A sweep's trials are ordinary jobs tagged with the sweep (jobs.sweep_id) and inserted through the
queue's own insert, so each inherits everything a job has: lease, fencing, resume, retries, logs,
metrics, artifacts. One server process at a time drives a sweep: it holds the sweep's lease
(driver, driver_until: the database's clock), and its writes are fenced by it, as a worker's are by
its claim.
"""
import json
import math
from typing import Any

from pydantic import ValidationError
from sqlalchemy import and_, case, func, insert, select, update
from sqlalchemy.engine import Engine

from trainyard.app import admission, queue
from trainyard.app.db import db_now, jobs, metrics, read, sweeps, write
from trainyard.app.errors import Conflict, Invalid, NotFound
from trainyard.app.records import Job
from trainyard.app.settings import Settings
from trainyard.app.spec import (
    DEFAULT_TRIALS,
    HIGHER_IS_BETTER,
    INTEGER,
    MAX_CHOICE_BYTES,
    MAX_CHOICE_VALUES,
    MAX_SWEEP_TRIALS,
    OTHER,
    TRAIN_SWEEP_METRICS,
    ChoiceParam,
    FloatParam,
    SweepSpec,
    field_kind,
    job_spec_adapter,
    range_count,
    with_params,
)
from trainyard.app.states import Failure, JobState, error_record

RUNNING, SUCCEEDED, FAILED, CANCELLED = "running", "succeeded", "failed", "cancelled"
SWEEP_STATES = (RUNNING, SUCCEEDED, FAILED, CANCELLED)
# Counts by trial: the job states, with pruned trials apart from the ones that failed.
COUNT_KEYS = ("queued", "running", "succeeded", "pruned", "failed", "cancelled")
# Choice values each checked by the job spec at submit; the workers' admission runs on the first few of
# each parameter, and on at most ADMIT_CALLS in all (each looks the installed plugins up: tens of ms).
ADMIT_VALUES = 8
ADMIT_CALLS = 32


# ---- submitting ---------------------------------------------------------------------------------

def admit(engine: Engine, settings: Settings, spec: SweepSpec) -> None:
    """Refuse a sweep that cannot run, naming the field: each path must be a field of the base job,
    ranges only on numbers, and every value checked, and the base job itself, must make a job the spec and
    the fleet accept."""
    kind = spec.job.kind
    base = spec.job.model_dump(mode="json")
    choices = [p.values for p in spec.parameters.values() if isinstance(p, ChoiceParam)]
    if sum(map(len, choices)) > MAX_CHOICE_VALUES:
        raise Invalid(f"the choices hold {sum(map(len, choices)):,} values in all; a sweep takes at most "
                      f"{MAX_CHOICE_VALUES:,}", loc=("parameters",))
    if sum(len(json.dumps(v)) for v in choices) > MAX_CHOICE_BYTES:
        raise Invalid(f"the choices' values are over {MAX_CHOICE_BYTES >> 10} KiB of JSON in all",
                      loc=("parameters",))
    for path, p in spec.parameters.items():
        at = ("parameters", path)
        try:
            holds = field_kind(path, kind)
        except ValueError as e:
            raise Invalid(str(e), loc=at) from None
        if isinstance(p, FloatParam) and holds == INTEGER:
            raise Invalid(f"{path} is an integer field: search it with type int or choice", loc=(*at, "type"))
        if not isinstance(p, ChoiceParam) and holds == OTHER:
            raise Invalid(f"{path} is not a number: a range (type {p.type}) needs a numeric field; "
                          "give its values with type choice", loc=(*at, "type"))
        values = p.values if isinstance(p, ChoiceParam) else [p.low, p.high]
        for i, value in enumerate(values):
            job = _trial_job(base, {path: value}, at)
            if i < min(ADMIT_VALUES, max(1, ADMIT_CALLS // len(spec.parameters))):
                try:
                    admission.admit(engine, settings, job)
                except Invalid as e:
                    raise Invalid(str(e), loc=at) from None
    if kind == "train" and spec.metric not in TRAIN_SWEEP_METRICS:
        raise Invalid(f"a train job reports {', '.join(TRAIN_SWEEP_METRICS)}; not {spec.metric!r}", loc=("metric",))
    if spec.method == "grid":
        try:
            size = spec.grid_size()
        except (ValueError, ArithmeticError) as e:
            raise Invalid(str(e), loc=("method",)) from None
        if spec.max_trials is not None and spec.max_trials < size:
            raise Invalid(f"the grid has {size:,} combinations; max_trials {spec.max_trials} would leave some out "
                          "(raise it, or use method random or tpe)", loc=("max_trials",))
        if size > MAX_SWEEP_TRIALS:
            raise Invalid(f"the grid has {size:,} combinations, over the limit of {MAX_SWEEP_TRIALS}",
                          loc=("parameters",))
    try:
        admission.admit(engine, settings, spec.job)
    except Invalid as e:
        raise Invalid(str(e), loc=("job", *(e.loc or ()))) from None


def _trial_job(base: dict, params: dict, at: tuple):
    try:
        return job_spec_adapter.validate_python(with_params(base, params))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"][1:])  # the first is the job's kind (the union's tag)
        shown = json.dumps(next(iter(params.values())))[:100]
        raise Invalid(f"{at[-1]} = {shown} makes a job the spec refuses: {where}: {first['msg']}", loc=at) from None


def trial_spec(spec: SweepSpec, trial: int, params: dict[str, Any]):
    """The job a trial runs (Invalid: the job spec refuses this combination of values)."""
    job = _trial_job(spec.job.model_dump(mode="json"), params, ("parameters",))
    return job.model_copy(update={"name": f"{spec.name or spec.job.name or 'sweep'}/trial-{trial}"[-200:]})


def create(engine: Engine, settings: Settings, spec: SweepSpec) -> dict:
    admit(engine, settings, spec)
    with write(engine) as conn:
        row = conn.execute(insert(sweeps).values(
            name=spec.name, state=RUNNING, spec=spec.model_dump(mode="json"), created_at=db_now(),
            trial_count=0).returning(sweeps)).one()
    return row._asdict()


# ---- reading ------------------------------------------------------------------------------------

def get(engine: Engine, sweep_id: int) -> dict:
    with read(engine) as conn:
        row = conn.execute(select(sweeps).where(sweeps.c.id == sweep_id)).first()
    if row is None:
        raise NotFound(f"sweep {sweep_id} not found")
    return row._asdict()


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


def summary(spec: dict) -> dict:
    """What a sweep's spec says of its plan, from the stored spec (validated when it was submitted): method,
    metric, direction, max_trials (SweepSpec.trials), max_concurrent."""
    return {"method": spec["method"], "metric": spec["metric"], "direction": _goal(spec),
            "max_trials": _planned(spec["method"], spec.get("max_trials"), lambda: spec["parameters"]),
            "max_concurrent": spec["max_concurrent"]}


def _planned(method: str, max_trials: int | None, parameters) -> int:
    """SweepSpec.trials of a stored spec; parameters() gives its parameters, called only for a grid."""
    if method != "grid":
        return max_trials or DEFAULT_TRIALS
    size = 1
    for p in parameters().values():
        if p["type"] == "choice":
            size *= len(p["values"])
        else:  # an int range, or a float range with a step (a grid has no other)
            size *= range_count(p["low"], p["high"], p.get("step") or 1)
    return min(size, max_trials or MAX_SWEEP_TRIALS)


def get_summary(engine: Engine, sweep_id: int) -> dict:
    """The sweep's row without its spec, with its summary (the spec's plan) in its place."""
    rows = _summarised(engine, _SUMMARISED.where(sweeps.c.id == sweep_id))
    if not rows:
        raise NotFound(f"sweep {sweep_id} not found")
    return rows[0]


def _summarised(engine: Engine, query) -> list[dict]:
    with read(engine) as conn:
        rows = [r._asdict() for r in conn.execute(query)]
    for r in rows:
        plan = {k: r.pop(k) for k in _SUMMARY}
        sweep_id = r["id"]
        if plan["method"] == "grid" and plan["max_trials"] is None:
            if sweep_id not in _grid_sizes:
                if len(_grid_sizes) > 10_000:
                    _grid_sizes.clear()
                _grid_sizes[sweep_id] = _planned("grid", None, lambda: _parameters(engine, sweep_id))
            planned = _grid_sizes[sweep_id]
        else:
            planned = _planned(plan["method"], plan["max_trials"], dict)
        r["summary"] = {**plan, "direction": _goal(plan), "max_trials": planned}
    return rows


def _parameters(engine: Engine, sweep_id: int) -> dict:
    with read(engine) as conn:
        return conn.execute(select(sweeps.c.spec["parameters"]).where(sweeps.c.id == sweep_id)).scalar_one()


def page(engine: Engine, state: str | None = None, limit: int = 50, offset: int = 0) -> tuple[list[dict], int]:
    """A page of sweeps without their specs (each with its summary instead), newest first, and how many match."""
    where = and_(True, *([sweeps.c.state == state] if state else []))
    with read(engine) as conn:
        total = conn.execute(select(func.count()).select_from(sweeps).where(where)).scalar_one()
    rows = _summarised(engine, _SUMMARISED.where(where).order_by(sweeps.c.id.desc()).limit(limit).offset(offset))
    return rows, total


_LIGHT = [c for c in jobs.c if c.name not in ("spec", "errors")]


def trials(engine: Engine, sweep_ids: list[int]) -> dict[int, list[Job]]:
    """Each sweep's trial jobs by trial number (the heavy spec and errors left unread)."""
    out: dict[int, list[Job]] = {i: [] for i in sweep_ids}
    if not sweep_ids:
        return out
    with read(engine) as conn:
        rows = conn.execute(select(*_LIGHT).where(jobs.c.sweep_id.in_(sweep_ids)).order_by(jobs.c.id)).all()
    for row in rows:
        job = Job.from_row(row)
        out[job.sweep_id].append(job)
    for found in out.values():
        found.sort(key=lambda j: j.sweep["trial"])
    return out


def failure(job: Job) -> str | None:
    return (job.error or {}).get("class") if job.state == JobState.FAILED else None


def trial_value(job: Job, metric: str) -> float | None:
    """The trial's metric: a finished train job's result holds its kept epoch's; otherwise the latest reported."""
    for source in ((job.result or {}) if job.state == JobState.SUCCEEDED else {}, job.latest_metrics or {}):
        value = source.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def best_trial(spec: dict, found: list[Job]) -> Job | None:
    """The succeeded trial with the best metric (the lowest trial number among equals)."""
    sign = -1.0 if _goal(spec) == "maximize" else 1.0
    done = [(sign * v, j.sweep["trial"], j) for j in found if j.state == JobState.SUCCEEDED
            and (v := trial_value(j, spec["metric"])) is not None]
    return min(done, key=lambda t: t[:2])[2] if done else None


def _goal(spec: dict) -> str:
    """SweepSpec.goal of a stored spec, without validating it again."""
    return spec.get("direction") or ("maximize" if HIGHER_IS_BETTER.get(spec["metric"]) else "minimize")


def counts(found: list[Job]) -> dict[str, int]:
    out = dict.fromkeys(COUNT_KEYS, 0)
    for j in found:
        out["pruned" if failure(j) == Failure.PRUNED else j.state.value] += 1
    return out


# Points of GET /sweeps/{id}/curves per response, at most (a limit of the request's own may be lower).
MAX_CURVE_POINTS = 10_000


def curves(engine: Engine, sweep_id: int, since: int = 0, limit: int = MAX_CURVE_POINTS) -> dict:
    """Every trial's metric per epoch, for one chart, a page at a time: the points recorded after the cursor
    `since` (0: from the start), at most `limit` of them, in the order they were recorded; `next` is the cursor
    of the next page (and of the points recorded later), `more` whether points were left for it. An epoch
    recorded again (a resumed run) comes again, later: the last point of an epoch is the one that holds."""
    row = get_summary(engine, sweep_id)
    plan = row["summary"]
    found = trials(engine, [sweep_id])[sweep_id]
    best = best_trial(plan, found)
    points: dict[int, list] = {j.id: [] for j in found}
    last, more = since, False
    if found:
        # "+ 0": walk the metrics in the order they were recorded (their primary key) from the cursor and stop at
        # the limit, rather than gather all of the trials' points through the (job, epoch) index to sort them.
        # The metric alone is taken out of each record's JSON, by the database (a number on SQLite, text on
        # PostgreSQL): no record is decoded whole.
        query = (select(metrics.c.id, metrics.c.job_id, metrics.c.epoch,
                        metrics.c.data[plan["metric"]].as_string().label("value"))
                 .where((metrics.c.job_id + 0).in_(list(points)), metrics.c.id > since)
                 .order_by(metrics.c.id).limit(limit + 1))
        with read(engine) as conn:
            rows = conn.execute(query).all()
        more = len(rows) > limit
        for r in rows[:limit]:
            last = r.id
            value = _number(r.value)
            if value is not None:
                points[r.job_id].append([r.epoch, value])
    return {"metric": plan["metric"], "direction": plan["direction"], "next": last, "more": more,
            "trials": [{"trial": j.sweep["trial"], "job_id": j.id, "state": j.state, "failure": failure(j),
                        "best": best is not None and j.id == best.id, "points": points[j.id]} for j in found]}


def _number(value) -> float | int | None:
    if isinstance(value, str):  # the metric's JSON text
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


# ---- client actions -------------------------------------------------------------------------------

def cancel(engine: Engine, sweep_id: int) -> dict:
    """End the sweep, then cancel its queued and running trials (their workers stop them within 2 s)."""
    with write(engine) as conn:
        state = conn.execute(select(sweeps.c.state).where(sweeps.c.id == sweep_id).with_for_update()).scalar()
        if state is None:
            raise NotFound(f"sweep {sweep_id} not found")
        if state != RUNNING:
            raise Conflict(f"sweep {sweep_id} is {state}; only a running sweep can be cancelled")
        conn.execute(update(sweeps).where(sweeps.c.id == sweep_id, sweeps.c.state == RUNNING)
                     .values(state=CANCELLED, finished_at=db_now(), error="cancelled by request"))
    stop_trials(engine, sweep_id, "the sweep was cancelled")
    return get(engine, sweep_id)


def stop_trials(engine: Engine, sweep_id: int, why: str) -> list[int]:
    with read(engine) as conn:
        ids = list(conn.execute(select(jobs.c.id).where(
            jobs.c.sweep_id == sweep_id, jobs.c.state.in_((queue.QUEUED, queue.RUNNING)))).scalars())
    return queue.stop(engine, ids, error_record(Failure.CANCELLED, "SweepEnded", why)) if ids else []


# ---- the driver's fenced writes -------------------------------------------------------------------

def driven(sweep_id: int, driver: str):
    return and_(sweeps.c.id == sweep_id, sweeps.c.state == RUNNING, sweeps.c.driver == driver)


def take(engine: Engine, sweep_id: int, driver: str, lease_s: float) -> bool:
    """Hold (or keep holding) the right to advance a running sweep for lease_s seconds."""
    return sweep_id in hold(engine, [sweep_id], driver, lease_s)


def hold(engine: Engine, sweep_ids: list[int], driver: str, lease_s: float) -> set[int]:
    """take() for many sweeps in one write (a driver renews all it holds at once); the ones now held."""
    with write(engine) as conn:
        return set(conn.execute(update(sweeps).where(
            sweeps.c.id.in_(sweep_ids), sweeps.c.state == RUNNING,
            (sweeps.c.driver == driver) | sweeps.c.driver.is_(None) | (sweeps.c.driver_until < db_now()))
            .values(driver=driver, driver_until=db_now() + lease_s).returning(sweeps.c.id)).scalars())


def running(engine: Engine) -> list[int]:
    with read(engine) as conn:
        return list(conn.execute(select(sweeps.c.id).where(sweeps.c.state == RUNNING).order_by(sweeps.c.id)).scalars())


# What of a sweep's trial jobs the driver watches: a job made, claimed, requeued, retried or ended, or one that
# reports an epoch, changes one of these sums (states counted apart, so that two changes cannot cancel out).
_ACTIVITY = (
    select(sweeps.c.id, func.count(jobs.c.id),
           *(func.sum(case((jobs.c.state == s, 1), else_=0)) for s in (queue.QUEUED, queue.RUNNING, queue.FAILED)),
           *(func.sum(func.coalesce(c, 0)) for c in (jobs.c.claim, jobs.c.attempt, jobs.c.epoch, jobs.c.epochs)),
           func.max(jobs.c.finished_at))
    .select_from(sweeps.outerjoin(jobs, jobs.c.sweep_id == sweeps.c.id))
    .where(sweeps.c.state == RUNNING).group_by(sweeps.c.id).order_by(sweeps.c.id))


def activity(engine: Engine) -> dict[int, tuple]:
    """Each running sweep, with a signature of its trial jobs that moves whenever one of them changes (one
    query: the driver advances only the sweeps whose signature moved)."""
    with read(engine) as conn:
        return {row[0]: tuple(row[1:]) for row in conn.execute(_ACTIVITY)}


def jobs_by_id(engine: Engine, job_ids: list[int]) -> dict[int, Job]:
    """Trial jobs by id, without their heavy spec and errors (the driver reads only its running trials')."""
    if not job_ids:
        return {}
    with read(engine) as conn:
        rows = conn.execute(select(*_LIGHT).where(jobs.c.id.in_(job_ids))).all()
    return {row.id: Job.from_row(row) for row in rows}


def enqueue_trial(engine: Engine, sweep_id: int, driver: str, trial: int, params: dict[str, Any],
                  job, admitted: admission.Admitted) -> Job | None:
    """Insert the trial's job while the sweep runs under this driver; the same trial never gets two: its
    job is found by (sweep, trial) under the sweep's row lock, never by an idempotency key, which a client
    could send first. None: the sweep has ended or another driver holds it."""
    with write(engine) as conn:
        if conn.execute(select(sweeps.c.id).where(driven(sweep_id, driver)).with_for_update()).first() is None:
            return None
        existing = conn.execute(select(jobs).where(jobs.c.sweep_id == sweep_id,
                                                   jobs.c.sweep["trial"].as_integer() == trial)).first()
        if existing is not None:
            return Job.from_row(existing)
        return queue.insert_job(conn, job, None, admitted.parameters, admitted.needs,
                                sweep={"id": sweep_id, "trial": trial, "params": params})


def note(engine: Engine, sweep_id: int, driver: str, trial_count: int) -> bool:
    """The trials made so far; a running sweep's error (why it waits) is cleared once trials are made again."""
    with write(engine) as conn:
        res = conn.execute(update(sweeps).where(driven(sweep_id, driver)).values(trial_count=trial_count, error=None))
    return res.rowcount == 1


def waiting(engine: Engine, sweep_id: int, driver: str, why: str) -> None:
    with write(engine) as conn:
        conn.execute(update(sweeps).where(driven(sweep_id, driver)).values(error=why[:2000]))


def finish(engine: Engine, sweep_id: int, driver: str, state: str, error: str | None = None) -> bool:
    with write(engine) as conn:
        res = conn.execute(update(sweeps).where(driven(sweep_id, driver)).values(
            state=state, error=error, finished_at=db_now(), driver=None, driver_until=None))
    if res.rowcount == 1 and state != SUCCEEDED:
        stop_trials(engine, sweep_id, f"the sweep {state}: {error}")
    return res.rowcount == 1
