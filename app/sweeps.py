"""Sweeps in the database: submit (validate, persist), read, cancel, and the fenced writes of the
process that advances a sweep (app/search.py owns the search itself).

A sweep's trials are ordinary jobs tagged with the sweep (jobs.sweep_id) and inserted through the
queue's own insert, so each inherits everything a job has: lease, fencing, resume, retries, logs,
metrics, artifacts. One server process at a time drives a sweep: it holds the sweep's lease
(driver, driver_until: the database's clock), and its writes are fenced by it, as a worker's are by
its claim.
"""
import json
from typing import Any

from pydantic import ValidationError
from sqlalchemy import and_, func, insert, select, update
from sqlalchemy.engine import Engine

from trainyard.app import admission, queue
from trainyard.app.db import db_now, jobs, metrics, read, sweeps, write
from trainyard.app.errors import Conflict, Invalid, NotFound
from trainyard.app.records import Job
from trainyard.app.settings import Settings
from trainyard.app.spec import (
    HIGHER_IS_BETTER,
    INTEGER,
    MAX_SWEEP_TRIALS,
    OTHER,
    TRAIN_SWEEP_METRICS,
    ChoiceParam,
    FloatParam,
    SweepSpec,
    field_kind,
    job_spec_adapter,
    with_params,
)
from trainyard.app.states import Failure, JobState, error_record

RUNNING, SUCCEEDED, FAILED, CANCELLED = "running", "succeeded", "failed", "cancelled"
SWEEP_STATES = (RUNNING, SUCCEEDED, FAILED, CANCELLED)
# Counts by trial: the job states, with pruned trials apart from the ones that failed.
COUNT_KEYS = ("queued", "running", "succeeded", "pruned", "failed", "cancelled")
# Choice values each checked by the job spec at submit; the workers' admission runs on the first few.
ADMIT_VALUES = 8


# ---- submitting ---------------------------------------------------------------------------------

def admit(engine: Engine, settings: Settings, spec: SweepSpec) -> None:
    """Refuse a sweep that cannot run, naming the field: each path must be a field of the base job,
    ranges only on numbers, and every value checked, and the base job itself, must make a job the spec and
    the fleet accept."""
    kind = spec.job.kind
    base = spec.job.model_dump(mode="json")
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
            if i < ADMIT_VALUES:
                try:
                    admission.admit(engine, settings, job)
                except Invalid as e:
                    raise Invalid(str(e), loc=at) from None
    if kind == "train" and spec.metric not in TRAIN_SWEEP_METRICS:
        raise Invalid(f"a train job reports {', '.join(TRAIN_SWEEP_METRICS)}; not {spec.metric!r}", loc=("metric",))
    if spec.method == "grid":
        try:
            size = spec.grid_size()
        except ValueError as e:
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


def page(engine: Engine, state: str | None = None, limit: int = 50, offset: int = 0) -> tuple[list[dict], int]:
    where = and_(True, *([sweeps.c.state == state] if state else []))
    with read(engine) as conn:
        total = conn.execute(select(func.count()).select_from(sweeps).where(where)).scalar_one()
        rows = conn.execute(select(sweeps).where(where).order_by(sweeps.c.id.desc()).limit(limit).offset(offset))
        return [r._asdict() for r in rows], total


def trials(engine: Engine, sweep_ids: list[int]) -> dict[int, list[Job]]:
    """Each sweep's trial jobs by trial number (the heavy spec and errors left unread)."""
    out: dict[int, list[Job]] = {i: [] for i in sweep_ids}
    if not sweep_ids:
        return out
    columns = [c for c in jobs.c if c.name not in ("spec", "errors")]
    with read(engine) as conn:
        rows = conn.execute(select(*columns).where(jobs.c.sweep_id.in_(sweep_ids)).order_by(jobs.c.id)).all()
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


def curves(engine: Engine, sweep_id: int) -> dict:
    """Every trial's metric per epoch, for one chart."""
    row = get(engine, sweep_id)
    spec = row["spec"]
    found = trials(engine, [sweep_id])[sweep_id]
    best = best_trial(spec, found)
    points: dict[int, list] = {j.id: [] for j in found}
    if found:
        with read(engine) as conn:
            for r in conn.execute(select(metrics.c.job_id, metrics.c.epoch, metrics.c.data)
                                  .where(metrics.c.job_id.in_(list(points))).order_by(metrics.c.epoch)):
                value = r.data.get(spec["metric"])
                if isinstance(value, (int, float)):
                    points[r.job_id].append([r.epoch, value])
    return {"metric": spec["metric"], "direction": _goal(spec),
            "trials": [{"trial": j.sweep["trial"], "job_id": j.id, "state": j.state, "failure": failure(j),
                        "best": best is not None and j.id == best.id, "points": points[j.id]} for j in found]}


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
    with write(engine) as conn:
        res = conn.execute(update(sweeps).where(
            sweeps.c.id == sweep_id, sweeps.c.state == RUNNING,
            (sweeps.c.driver == driver) | sweeps.c.driver.is_(None) | (sweeps.c.driver_until < db_now()))
            .values(driver=driver, driver_until=db_now() + lease_s))
    return res.rowcount == 1


def running(engine: Engine) -> list[int]:
    with read(engine) as conn:
        return list(conn.execute(select(sweeps.c.id).where(sweeps.c.state == RUNNING).order_by(sweeps.c.id)).scalars())


def enqueue_trial(engine: Engine, sweep_id: int, driver: str, trial: int, params: dict[str, Any],
                  job, admitted: admission.Admitted) -> Job | None:
    """Insert the trial's job while the sweep runs under this driver; the same trial never gets two
    (its idempotency key). None: the sweep has ended or another driver holds it."""
    key = f"sweep-{sweep_id}-trial-{trial}"
    with write(engine) as conn:
        if conn.execute(select(sweeps.c.id).where(driven(sweep_id, driver)).with_for_update()).first() is None:
            return None
        existing = conn.execute(select(jobs).where(jobs.c.idempotency_key == key)).first()
        if existing is not None:
            return Job.from_row(existing)
        return queue.insert_job(conn, job, key, admitted.parameters, admitted.needs,
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
