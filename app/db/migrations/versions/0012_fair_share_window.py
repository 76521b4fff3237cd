"""Fair share's read of recent device time bounded by an index: jobs (project_id, finished_at), so that the claim
reads the competing projects' jobs that ended within its window (eight half-lives), not every job retention keeps
(app/fleet/fair_share.py's usage).

Revision ID: 0012
Revises: 0011
"""
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_project_finished", "jobs", ["project_id", "finished_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_project_finished", table_name="jobs")
