"""Sweeps: a search over a job's fields whose trials are jobs, and the log of its Optuna study.

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200)),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float),
        sa.Column("error", sa.Text),
        sa.Column("trial_count", sa.Integer, nullable=False),
        sa.Column("driver", sa.String(200)),
        sa.Column("driver_until", sa.Float),
    )
    op.create_index("ix_sweeps_state", "sweeps", ["state"])
    op.create_table(
        "sweep_log",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("sweep_id", sa.Integer, sa.ForeignKey("sweeps.id", ondelete="CASCADE"), nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("entry", sa.JSON, nullable=False),
        sa.UniqueConstraint("sweep_id", "seq", name="uq_sweep_log_seq"),
    )
    op.add_column("jobs", sa.Column("sweep_id", sa.Integer))
    op.add_column("jobs", sa.Column("sweep", sa.JSON))
    op.create_index("ix_jobs_sweep_id", "jobs", ["sweep_id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_sweep_id", "jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("sweep")
        batch.drop_column("sweep_id")
    op.drop_table("sweep_log")
    op.drop_index("ix_sweeps_state", "sweeps")
    op.drop_table("sweeps")
