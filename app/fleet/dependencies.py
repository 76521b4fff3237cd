"""Jobs that wait for jobs: what a job waits on (its `after`, and the job its model_job or init_from names),
kept as rows of job_deps; the claim's condition that they have all succeeded; what a queued job still waits
on (its waiting_for); the queued jobs that can never start because one of theirs ended otherwise (failed,
cancelled, pruned, or deleted: a dependency with no row), which the server's housekeeping fails with class
`dependency` (app/duties/loops.py); a batch's "$N" references to its own earlier jobs; and "sweep:<id>:best"
(model_job, init_from), a job_sweeps row until the sweep ends, then its best trial's id in the spec and a
job_deps row (or, with no best trial, a dependency failure).

No cycle can arise: ids are assigned at insert, so a job waits only on jobs that existed before it (or on
earlier jobs of its own batch, "$N" with N below its position), and nothing changes a job's dependencies
after its insert (a retry keeps them). A job naming itself can only name an id not yet made: unknown, a 422.
"""
import functools

from sqlalchemy import (
    CompoundSelect,
    and_,
    delete,
    exists,
    insert,
    literal_column,
    or_,
    select,
    union_all,
    update,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

from trainyard.app.accounts import Principal
from trainyard.app.core.errors import Invalid, NotFound
from trainyard.app.core.states import ErrorRecord, Failure, JobState, SweepState, error_record
from trainyard.app.db import ids_in, job_deps, job_sweeps, jobs, read, sweeps
from trainyard.app.records import sweep_reads, sweep_results
from trainyard.app.spec import PredictJob, RunJob, TrainJob

SUCCEEDED = JobState.SUCCEEDED.value
# A dependency in one of these (or deleted) will never succeed: its dependents fail.
NEVER = (JobState.FAILED.value, JobState.CANCELLED.value, JobState.PRUNED.value)


def model_field(spec: TrainJob | PredictJob | RunJob) -> str | None:
    """The field naming the job whose model this one uses: model_job (predict), init_from (train)."""
    if isinstance(spec, PredictJob):
        return "model_job"
    return "init_from" if isinstance(spec, TrainJob) and spec.init_from is not None else None


def references(spec: TrainJob | PredictJob | RunJob) -> list[tuple[tuple, int | str]]:
    """Every job the spec names, with the request field it is named by: ("after", k), ("model_job",)..."""
    found: list[tuple[tuple, int | str]] = [(("after", k), ref) for k, ref in enumerate(spec.after)]
    field = model_field(spec)
    if field is not None:
        found.append(((field,), getattr(spec, field)))
    return found


def waits_on(spec: TrainJob | PredictJob | RunJob) -> list[int]:
    """The ids of the jobs it waits for (references resolved: ids only), each once."""
    return sorted({ref for _, ref in references(spec) if isinstance(ref, int)})


def names_any(spec: TrainJob | PredictJob | RunJob) -> bool:
    """Whether the spec names a job or a sweep it waits for (a batch's "$N" included, before it is resolved)."""
    return bool(references(spec))


def batch_position(ref: str, position: int | None, loc: tuple) -> int:
    """The position a "$N" reference names, once it is valid where it is: in a batch (position is the
    referring job's own), and before the job that refers to it."""
    n = int(ref[1:])
    if position is None:
        raise Invalid(f"{ref} names a job of the same batch; submit the jobs together with POST /jobs/batch",
                      loc=loc)
    if n >= position:
        raise Invalid(f"{ref} names {'this job' if n == position else 'a later job of the batch'}; a job may "
                      f"wait only for jobs before it in the batch (this is ${position})", loc=loc)
    return n


def resolve(spec: TrainJob | PredictJob | RunJob, ids: list[int]) -> TrainJob | PredictJob | RunJob:
    """The spec with each "$N" replaced by the id the batch's job N got."""
    def one(ref: int | str) -> int | str:
        return ids[int(ref[1:])] if isinstance(ref, str) and ref.startswith("$") else ref
    update: dict = {"after": [one(r) for r in spec.after]}
    field = model_field(spec)
    if field is not None:
        update[field] = one(getattr(spec, field))
    return spec.model_copy(update=update)


def record(conn: Connection, job_id: int, spec: TrainJob | PredictJob | RunJob) -> None:
    """The new job's dependencies, in its INSERT's transaction."""
    ids = waits_on(spec)
    if ids:
        conn.execute(insert(job_deps), [{"job_id": job_id, "after_id": i} for i in ids])
    field = model_field(spec)
    ref = getattr(spec, field) if field else None
    if isinstance(ref, str) and ref.startswith("sweep:"):
        conn.execute(insert(job_sweeps).values(job_id=job_id, sweep_id=sweep_of(ref), field=field))


def ready() -> ColumnElement[bool]:
    """The claim's condition: every job this one waits for has succeeded (a deleted one has not)."""
    dep, parent = _READY_DEP, _READY_PARENT
    done = exists().where(parent.c.id == dep.c.after_id, parent.c.state == SUCCEEDED)
    return and_(~exists().where(dep.c.job_id == jobs.c.id, ~done), ~exists().where(job_sweeps.c.job_id == jobs.c.id))


# ready()'s aliases, built once (issue 40, the claim's part): a jobs alias's column proxies, made at each call,
# were a sixth of a claim's CPU.
_READY_DEP, _READY_PARENT = job_deps.alias("dep"), jobs.alias("parent")


def unmet(engine: Engine, job_ids: list[int]) -> dict[int, list[str]]:
    """For each of these jobs that waits on some, the jobs (and sweep) it still waits on, with their states."""
    if not job_ids:
        return {}
    with read(engine) as conn:
        return unmet_on(conn, job_ids)


def unmet_on(conn: Connection, job_ids: list[int]) -> dict[int, list[str]]:
    """unmet's answer on the caller's connection (a list page reads it with its rows): one statement, built once
    (an alias of jobs built per call, its forty columns' proxies, was most of a list page's waiting_for)."""
    found: dict[int, list[str]] = {}
    for job_id, kind, ref, state in conn.execute(_unmet(conn.dialect.name), {"ids": list(job_ids)}):
        found.setdefault(job_id, []).append(f"job {ref} ({state or 'deleted'})" if kind == 0
                                            else f"sweep {ref}'s best trial ({state or 'deleted'})")
    return found


_parent = jobs.alias("parent")


@functools.cache
def _unmet(dialect: str) -> CompoundSelect:
    """The jobs each job waits on that have not succeeded (kind 0), then the sweeps whose best it waits for (kind 1)."""
    return union_all(
        select(job_deps.c.job_id, literal_column("0").label("kind"), job_deps.c.after_id.label("ref"),
               _parent.c.state)
        .select_from(job_deps.outerjoin(_parent, _parent.c.id == job_deps.c.after_id))
        .where(ids_in(job_deps.c.job_id, dialect), or_(_parent.c.state.is_(None), _parent.c.state != SUCCEEDED)),
        select(job_sweeps.c.job_id, literal_column("1"), job_sweeps.c.sweep_id, sweeps.c.state)
        .select_from(job_sweeps.outerjoin(sweeps, sweeps.c.id == job_sweeps.c.sweep_id))
        .where(ids_in(job_sweeps.c.job_id, dialect)),
    ).order_by("job_id", "kind", "ref")


def waiting_for(unmet_deps: list[str]) -> str:
    """A queued job's waiting_for while what it waits on has not succeeded (or, a sweep, ended)."""
    return f"what it waits for to succeed: {', '.join(unmet_deps)}"


def broken(conn: Connection) -> dict[int, tuple[int, str | None]]:
    """Queued jobs that wait on a job that will never succeed: job id -> (that job's id, its state; None:
    deleted). One indexed read, whatever the queue holds."""
    parent = jobs.alias("parent")
    rows = conn.execute(
        select(job_deps.c.job_id, job_deps.c.after_id, parent.c.state)
        .select_from(job_deps.join(jobs, and_(jobs.c.id == job_deps.c.job_id, jobs.c.state == JobState.QUEUED.value))
                     .outerjoin(parent, parent.c.id == job_deps.c.after_id))
        .where(or_(parent.c.id.is_(None), parent.c.state.in_(NEVER)))
        .order_by(job_deps.c.job_id, job_deps.c.after_id))
    found: dict[int, tuple[int, str | None]] = {}
    for job_id, after_id, state in rows:
        found.setdefault(job_id, (after_id, state))
    return found


def failure(after_id: int, state: str | None) -> ErrorRecord:
    """The error of a job that fails because a job it waits for ended otherwise than succeeded."""
    how = "was deleted" if state is None else f"ended {state}"
    return error_record(Failure.DEPENDENCY, "DependencyFailed", f"job {after_id}, which this job waits for, {how}")


# ---- "sweep:<id>:best" -----------------------------------------------------------------------------

def sweep_of(ref: str) -> int:
    return int(ref.split(":")[1])


def best_of(engine: Engine, sweep_id: int) -> int | None:
    """The id of the sweep's best trial so far (None: none succeeded with its metric); NotFound: no sweep."""
    sweep = sweep_reads.get(engine, sweep_id)
    found = sweep_reads.trials(engine, [sweep_id])[sweep_id]
    best = sweep_results.best_trial(sweep.spec or {}, found)
    return None if best is None else best.id


def sweep_at_submit(engine: Engine, ref: str, at: tuple, waits: bool = True, who: Principal | None = None
                    ) -> int | None:
    """A "sweep:<id>:best" at submit: its best trial's id once the sweep has ended, None while it runs (the job
    waits); a 422 for a sweep that does not exist (or that `who` may not see: another project's), one that ended
    with no best trial, or one still running where the job may not wait (a sweep's base job)."""
    try:
        state = sweep_reads.get_summary(engine, sweep_of(ref), who).state
        best = None if state == SweepState.RUNNING else best_of(engine, sweep_of(ref))
    except NotFound:
        raise Invalid(f"{at[0]} {ref}: sweep {sweep_of(ref)} does not exist", loc=at) from None
    if state != SweepState.RUNNING and best is None:
        raise Invalid(f"{at[0]} {ref}: sweep {sweep_of(ref)} ended {state} with no best trial", loc=at)
    if best is None and not waits:
        raise Invalid(f"{at[0]} {ref}: sweep {sweep_of(ref)} is running; it must have ended", loc=at)
    return best


def sweeps_ended(conn: Connection) -> list[tuple[int, int, str, str | None]]:
    """Queued jobs waiting on a sweep that has ended (or was deleted): (job id, sweep id, field, sweep state)."""
    return [tuple(r) for r in conn.execute(
        select(job_sweeps.c.job_id, job_sweeps.c.sweep_id, job_sweeps.c.field, sweeps.c.state)
        .select_from(job_sweeps.join(jobs, and_(jobs.c.id == job_sweeps.c.job_id,
                                                jobs.c.state == JobState.QUEUED.value))
                     .outerjoin(sweeps, sweeps.c.id == job_sweeps.c.sweep_id))
        .where(or_(sweeps.c.id.is_(None), sweeps.c.state != SweepState.RUNNING.value)))]


def settle(conn: Connection, job_id: int, field: str, best: int) -> bool:
    """The sweep's best trial takes the reference's place: in the spec the worker reads, and as a job the job
    waits on (its dependency from now on, as if named by id). False if the job is no longer queued."""
    spec = conn.execute(select(jobs.c.spec).where(jobs.c.id == job_id, jobs.c.state == JobState.QUEUED.value)
                        .with_for_update()).scalar()
    if spec is None:
        return False
    conn.execute(update(jobs).where(jobs.c.id == job_id).values(spec={**spec, field: best}))
    if conn.execute(select(job_deps.c.job_id).where(job_deps.c.job_id == job_id,
                                                    job_deps.c.after_id == best)).first() is None:
        conn.execute(insert(job_deps).values(job_id=job_id, after_id=best))
    conn.execute(delete(job_sweeps).where(job_sweeps.c.job_id == job_id))
    return True


def sweep_failure(sweep_id: int, state: str | None) -> ErrorRecord:
    how = "was deleted" if state is None else f"ended {state} with no best trial"
    return error_record(Failure.DEPENDENCY, "DependencyFailed",
                        f"sweep {sweep_id}, whose best trial this job waits for, {how}")
