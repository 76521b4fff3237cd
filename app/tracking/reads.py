"""What a job's record says of its MLflow run (GET /jobs/{id}'s `tracking`): where it is and whether it is complete."""
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine

from trainyard.app.core.settings import Settings
from trainyard.app.db import read, tracked_runs
from trainyard.app.tracking import fields


def of_job(engine: Engine, settings: Settings, job_id: int) -> dict[str, Any] | None:
    """None where the job is not tracked (the service names no tracker, or the spec opted out)."""
    if not settings.mlflow_tracking_uri:
        return None
    with read(engine) as conn:
        row = conn.execute(select(tracked_runs).where(tracked_runs.c.job_id == job_id)).first()
    if row is None:
        return None
    return {"mlflow": {
        "run_id": row.run_id, "experiment_id": row.experiment_id,
        "url": fields.run_url(settings.mlflow_tracking_uri, row.experiment_id, row.run_id),
        "complete": not row.pending, "status": row.status, "error": row.error,
        "earlier_runs": row.earlier_runs or [], "model_version": row.model_version,
    }}
