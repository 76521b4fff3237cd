"""Jobs across hosts: jobs.hosts, the hosts a multi-device job's devices are spread over (NULL: one, as every
job of earlier releases).

Revision ID: 0010
Revises: 0009
"""
import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("hosts", sa.Integer))


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35+ has it): a batch copy of jobs would cascade into metrics (see 0006).
    op.execute("ALTER TABLE jobs DROP COLUMN hosts")
