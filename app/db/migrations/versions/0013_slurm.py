"""Jobs that run in Slurm allocations (app/clusters/): where a job runs (jobs.runs_on; NULL: trainyard's own
workers), its latest allocation as last seen (jobs.slurm), and every allocation asked for (slurm_allocations).

Revision ID: 0013
Revises: 0012
"""
import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("runs_on", sa.String(16)))
    op.add_column("jobs", sa.Column("slurm", sa.JSON()))
    op.create_table(
        "slurm_allocations",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("slurm_id", sa.String(64)),
        sa.Column("partition", sa.String(64)),
        sa.Column("nodes", sa.String(2000)),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("reason", sa.String(200)),
        sa.Column("claim", sa.Integer()),
        sa.Column("asked_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float()),
        sa.Column("ended_at", sa.Float()),
        sa.Column("outcome", sa.String(500)),
    )
    op.create_index("ix_slurm_allocations_job_id", "slurm_allocations", ["job_id"])
    op.create_index("ix_slurm_allocations_ended_at", "slurm_allocations", ["ended_at"])


def downgrade() -> None:
    op.drop_table("slurm_allocations")
    # Plain DROP COLUMN (SQLite 3.35+ has it): a batch copy of jobs would cascade into metrics (see 0006).
    op.execute("ALTER TABLE jobs DROP COLUMN slurm")
    op.execute("ALTER TABLE jobs DROP COLUMN runs_on")
