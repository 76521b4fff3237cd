"""Jobs that wait for jobs: job_deps(job_id, after_id), one row per job a queued job waits on (its `after`,
and the job its model_job or init_from names), and job_sweeps(job_id, sweep_id, field), a job whose model_job or
init_from is a sweep's best trial ("sweep:<id>:best") until that sweep ends. Jobs of earlier releases wait on none.

Revision ID: 0007
Revises: 0006
"""
import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_deps",
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("after_id", sa.Integer, primary_key=True),
    )
    op.create_index("ix_job_deps_after_id", "job_deps", ["after_id"])
    op.create_table(
        "job_sweeps",
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("sweep_id", sa.Integer, nullable=False),
        sa.Column("field", sa.String(16), nullable=False),
    )
    op.create_index("ix_job_sweeps_sweep_id", "job_sweeps", ["sweep_id"])


def downgrade() -> None:
    op.drop_index("ix_job_sweeps_sweep_id", table_name="job_sweeps")
    op.drop_table("job_sweeps")
    op.drop_index("ix_job_deps_after_id", table_name="job_deps")
    op.drop_table("job_deps")
