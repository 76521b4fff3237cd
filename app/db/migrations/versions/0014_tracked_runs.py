"""MLflow runs of jobs and sweeps (app/tracking/): what has been sent of each, so that the server sends every epoch
once, across restarts, retries and hosts.

Revision ID: 0014
Revises: 0013
"""
import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tracked_runs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), unique=True),
        sa.Column("sweep_id", sa.Integer, sa.ForeignKey("sweeps.id", ondelete="CASCADE"), unique=True),
        sa.Column("pending", sa.Boolean, nullable=False),
        sa.Column("experiment_id", sa.String(64)),
        sa.Column("run_id", sa.String(64)),
        sa.Column("earlier_runs", sa.JSON),
        sa.Column("sent_params", sa.Boolean, nullable=False),
        sa.Column("sent_epoch", sa.Integer, nullable=False),
        sa.Column("ended_claim", sa.Integer),
        sa.Column("status", sa.String(16)),
        sa.Column("model_version", sa.String(32)),
        sa.Column("error", sa.Text),
        sa.Column("failures", sa.Integer, nullable=False),
        sa.Column("retry_at", sa.Float),
        sa.Column("mirror", sa.String(200)),
        sa.Column("mirror_until", sa.Float),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_tracked_runs_pending", "tracked_runs", ["pending"])


def downgrade() -> None:
    op.drop_index("ix_tracked_runs_pending", table_name="tracked_runs")
    op.drop_table("tracked_runs")
