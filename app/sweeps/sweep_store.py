"""The sweep store: the only code that writes a sweep's row (its state above all), as app/jobs/queue.py is for a
job's. Submit (admitted, then stored), cancel, and the fenced writes of the process that advances a sweep
(app/sweeps/search.py, which calls here and never the other way).

A sweep's trials are ordinary jobs tagged with the sweep (jobs.sweep_id) and inserted through the
queue's own insert, so each inherits everything a job has: lease, fencing, resume, retries, logs,
metrics, artifacts. One server process at a time drives a sweep: it holds the sweep's lease
(driver, driver_until: the database's clock), and its writes are fenced by it, as a worker's are by
its claim.
"""
from typing import Any

from sqlalchemy import and_, insert, select, update
from sqlalchemy.engine import Connection, Engine

from trainyard.app.accounts import ADMIN, Principal
from trainyard.app.core.errors import Conflict, NotFound
from trainyard.app.core.settings import Settings
from trainyard.app.core.states import Failure, SweepState, error_record
from trainyard.app.db import db_now, jobs, sweeps, write
from trainyard.app.jobs import admission, queue, submit, tracked
from trainyard.app.records import Job, Sweep, sweep_reads
from trainyard.app.records.sweep_results import summary
from trainyard.app.spec import JobSpec, SweepSpec
from trainyard.app.sweeps.sweep_admission import admit

RUNNING = SweepState.RUNNING.value


def create(engine: Engine, settings: Settings, spec: SweepSpec, who: Principal = ADMIN) -> Sweep:
    """Store a sweep the service can run (Invalid, naming the field, otherwise); it starts running, in who's
    project and owned by them (its trials too)."""
    admit(engine, settings, spec, who)
    with write(engine) as conn:
        row = conn.execute(insert(sweeps).values(
            name=spec.name, state=RUNNING, spec=spec.model_dump(mode="json"), created_at=db_now(),
            trial_count=0, project_id=who.project_id, owner=who.user).returning(sweeps)).one()
        tracked.mark_sweep(conn, row.id, spec.job)
    values = row._asdict()
    return Sweep.from_values(values, summary(values["spec"]))


def cancel(engine: Engine, sweep_id: int) -> Sweep:
    """End the sweep, then cancel its queued and running trials (their workers stop them within 2 s)."""
    with write(engine) as conn:
        state = conn.execute(select(sweeps.c.state).where(sweeps.c.id == sweep_id).with_for_update()).scalar()
        if state is None:
            raise NotFound(f"sweep {sweep_id} not found")
        if state != RUNNING:
            raise Conflict(f"sweep {sweep_id} is {state}; only a running sweep can be cancelled")
        conn.execute(update(sweeps).where(sweeps.c.id == sweep_id, sweeps.c.state == RUNNING)
                     .values(state=SweepState.CANCELLED.value, finished_at=db_now(), error="cancelled by request"))
    stop_trials(engine, sweep_id, "the sweep was cancelled")
    return sweep_reads.get(engine, sweep_id)


def stop_trials(engine: Engine, sweep_id: int, why: str) -> list[int]:
    ids = sweep_reads.active_trials(engine, sweep_id)
    return queue.stop(engine, ids, error_record(Failure.CANCELLED, "SweepEnded", why)) if ids else []


# ---- the driver's fenced writes -------------------------------------------------------------------

def driven(sweep_id: int, driver: str):
    return and_(sweeps.c.id == sweep_id, sweeps.c.state == RUNNING, sweeps.c.driver == driver)


def fence(conn: Connection, sweep_id: int, driver: str) -> bool:
    """In a write transaction: lock the sweep's row while it runs under this driver; False if it does not."""
    return conn.execute(select(sweeps.c.id).where(driven(sweep_id, driver)).with_for_update()).first() is not None


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


def enqueue_trial(engine: Engine, sweep_id: int, driver: str, trial: int, params: dict[str, Any],
                  job: JobSpec, admitted: admission.Admitted, known: int = 0) -> Job | None:
    """Insert the trial's job while the sweep runs under this driver; the same trial never gets two: its
    job is found by (sweep, trial) under the sweep's row lock, never by an idempotency key, which a client
    could send first. `known`: the driver knows every trial job of the sweep up to this job id (it read them
    after it took the sweep), so only the later ones are looked through. None: the sweep has ended or another
    driver holds it. The job is the sweep's project's and its owner's."""
    with write(engine) as conn:
        held = conn.execute(select(sweeps.c.project_id, sweeps.c.owner).where(driven(sweep_id, driver))
                            .with_for_update()).first()  # fence(), reading whose the sweep is
        if held is None:
            return None
        # (sweep_id, id > known): a range of the sweep_id index (which holds each row's id), not every trial.
        existing = conn.execute(select(jobs).where(jobs.c.sweep_id == sweep_id, jobs.c.id > known,
                                                   jobs.c.sweep["trial"].as_integer() == trial)).first()
        if existing is not None:
            return Job.from_row(existing)
        return submit.insert_job(conn, job, None, admitted.parameters, admitted.needs,
                                 sweep={"id": sweep_id, "trial": trial, "params": params},
                                 project_id=held.project_id, owner=held.owner)


def note(engine: Engine, sweep_id: int, driver: str, trial_count: int) -> bool:
    """The trials made so far; a running sweep's error (why it waits) is cleared once trials are made again."""
    with write(engine) as conn:
        res = conn.execute(update(sweeps).where(driven(sweep_id, driver)).values(trial_count=trial_count, error=None))
    return res.rowcount == 1


def waiting(engine: Engine, sweep_id: int, driver: str, why: str) -> None:
    with write(engine) as conn:
        conn.execute(update(sweeps).where(driven(sweep_id, driver)).values(error=why[:2000]))


def finish(engine: Engine, sweep_id: int, driver: str, state: SweepState, error: str | None = None) -> bool:
    """End the sweep the driver holds (its trials still queued or running stopped, unless it succeeded)."""
    with write(engine) as conn:
        res = conn.execute(update(sweeps).where(driven(sweep_id, driver)).values(
            state=state.value, error=error, finished_at=db_now(), driver=None, driver_until=None))
    if res.rowcount == 1 and state != SweepState.SUCCEEDED:
        stop_trials(engine, sweep_id, f"the sweep {state}: {error}")
    return res.rowcount == 1
