"""Prometheus counters kept with the events they count, and when a queued job entered the queue.

Revision ID: 0004
Revises: 0003
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Counters start at zero here: the rows of earlier releases cannot tell what happened to jobs since
    # deleted or retried, and Prometheus reads a new series' first value as its start.
    op.create_table(
        "counters",
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("labels", sa.String(500), primary_key=True),
        sa.Column("value", sa.Float, nullable=False),
    )
    op.add_column("jobs", sa.Column("queued_at", sa.Float))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("queued_at")
    op.drop_table("counters")
