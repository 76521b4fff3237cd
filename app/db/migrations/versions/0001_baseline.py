"""The schema of the first releases (jobs, metrics, workers), as `create_all` made it before migrations.

A database made then has these tables and no alembic_version: app/db/migrate.py stamps it with this
revision before upgrading it.

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    _create_jobs()
    op.create_table(
        "metrics",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("epoch", sa.Integer, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.UniqueConstraint("job_id", "epoch", name="uq_metrics_job_epoch"),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.String(200), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("device", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("job_id", sa.Integer),
        sa.Column("stats", sa.JSON),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("last_heartbeat", sa.Float, nullable=False),
    )


def _create_jobs() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("name", sa.String(200)),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("device_req", sa.String(16), nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("timeout_s", sa.Float),
        sa.Column("idempotency_key", sa.String(200), unique=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("claim", sa.Integer, nullable=False),
        sa.Column("worker_id", sa.String(200)),
        sa.Column("device", sa.String(16)),
        sa.Column("lease_expires_at", sa.Float),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float),
        sa.Column("finished_at", sa.Float),
        sa.Column("epoch", sa.Integer),
        sa.Column("epochs", sa.Integer),
        sa.Column("latest_metrics", sa.JSON),
        sa.Column("peak_memory_allocated", sa.BigInteger),
        sa.Column("peak_memory_reserved", sa.BigInteger),
        sa.Column("parameters", sa.BigInteger),
        sa.Column("need_model", sa.String(100)),
        sa.Column("need_dataset", sa.String(100)),
        sa.Column("need_entrypoint", sa.String(100)),
        sa.Column("checkpoint_path", sa.Text),
        sa.Column("checkpoint_epoch", sa.Integer),
        sa.Column("artifact_path", sa.Text),
        sa.Column("result", sa.JSON),
        sa.Column("error", sa.JSON),
        sa.Column("errors", sa.JSON),
    )
    op.create_index("ix_jobs_state", "jobs", ["state"])
    op.create_index("ix_jobs_claim_order", "jobs", ["state", "priority", "id"])
    op.create_index("ix_jobs_queued_device", "jobs", ["state", "device_req"])


def downgrade() -> None:
    op.drop_table("metrics")
    op.drop_table("workers")
    op.drop_table("jobs")
