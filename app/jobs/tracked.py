"""Which jobs and sweeps become MLflow runs: a tracked_runs row made with them, in their own transaction, where the
service names a tracking server (TRAINYARD_MLFLOW_TRACKING_URI) and the spec does not opt out (tracking.mlflow:
false). What a row holds, and the sending, are app/tracking/'s; here only its making, and its waking on a retry.

Tracked kinds: train and run jobs, and predict jobs on data (an evaluation, which reports accuracy and loss); a
predict job on inputs returns rows, not results worth a run.
"""
from sqlalchemy import insert, update
from sqlalchemy.engine import Connection

from trainyard.app.core.settings import get_settings
from trainyard.app.db import tracked_runs
from trainyard.app.spec.jobs import PredictJob, RunJob, TrainJob


def wanted(spec: TrainJob | PredictJob | RunJob) -> bool:
    if not get_settings().mlflow_tracking_uri or (spec.tracking is not None and not spec.tracking.mlflow):
        return False
    return not isinstance(spec, PredictJob) or spec.data is not None


def mark_job(conn: Connection, job_id: int, spec: TrainJob | PredictJob | RunJob) -> None:
    if wanted(spec):
        _insert(conn, job_id=job_id)


def mark_sweep(conn: Connection, sweep_id: int, base: TrainJob | RunJob) -> None:
    if wanted(base):
        _insert(conn, sweep_id=sweep_id)


def _insert(conn: Connection, **of: int) -> None:
    conn.execute(insert(tracked_runs).values(**of, pending=True, sent_params=False, sent_epoch=0, failures=0))


def wake(conn: Connection, job_id: int) -> None:
    """The job was retried: its tracking is pending again (the next send sees the new claim and makes a new run)."""
    conn.execute(update(tracked_runs).where(tracked_runs.c.job_id == job_id).values(pending=True, retry_at=None))
