"""The tables of what trainyard sends to experiment trackers (app/tracking/), beside app/db/tables.py's and on its
metadata: tracked_runs."""
from sqlalchemy import JSON, Boolean, Column, Float, ForeignKey, Integer, String, Table, Text

from trainyard.app.db.tables import metadata

# A job's or a sweep's run in an MLflow tracking server (app/tracking/): what has been sent of it. Made with the
# job or sweep where the service tracks (TRAINYARD_MLFLOW_TRACKING_URI), `pending` until the tracker holds all that
# its records hold; a retry of the job makes it pending again, for a new run. The server process sending it holds
# it until mirror_until (database clock), as a sweep's driver holds a sweep: one sender at a time across hosts.
tracked_runs = Table(
    "tracked_runs", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", Integer, ForeignKey("jobs.id", ondelete="CASCADE"), unique=True),
    Column("sweep_id", Integer, ForeignKey("sweeps.id", ondelete="CASCADE"), unique=True),
    Column("pending", Boolean, nullable=False, index=True),
    Column("experiment_id", String(64)),
    Column("run_id", String(64)),  # the job's current MLflow run; NULL: not made yet
    Column("earlier_runs", JSON),  # its runs before a retry, oldest first
    Column("sent_params", Boolean, nullable=False, default=False),
    Column("sent_epoch", Integer, nullable=False, default=0),  # epochs 1..sent_epoch are in the run
    Column("ended_claim", Integer),  # the job's claim when its run was ended: a later claim is a retry
    Column("status", String(16)),  # the run's status as last sent (RUNNING, FINISHED, FAILED, KILLED)
    Column("model_version", String(32)),  # the registered model's version, once made
    Column("error", Text),  # the tracker's last error; NULL: the last send worked
    Column("failures", Integer, nullable=False, default=0),  # sends that failed in a row
    Column("retry_at", Float),
    Column("mirror", String(200)),
    Column("mirror_until", Float),
    sqlite_autoincrement=True,
)
