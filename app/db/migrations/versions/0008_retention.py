"""Retention: jobs.reclaimed (a job whose files retention removed while keeping its row: a sweep trial outside
the sweep's best k), and storage_usage (the stored bytes and objects of each kind at the collector's last
listing). Jobs of earlier releases have had nothing reclaimed.

Revision ID: 0008
Revises: 0007
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("reclaimed", sa.JSON))
    op.create_table(
        "storage_usage",
        sa.Column("kind", sa.String(16), primary_key=True),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("objects", sa.BigInteger, nullable=False),
        sa.Column("measured_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("storage_usage")
    # Plain DROP COLUMN (SQLite 3.35+ has it): a batch copy of jobs would cascade into metrics (see 0006).
    op.execute("ALTER TABLE jobs DROP COLUMN reclaimed")
