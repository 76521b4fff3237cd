"""A pruned sweep trial is a job state of its own, `pruned`: the jobs earlier releases ended `failed` with the
error class "pruned" become `pruned` (their error, which says at which epoch and why, stays). Down: back to
`failed` with that class.

Revision ID: 0005
Revises: 0004
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# The columns it reads and writes, as they are at this revision.
jobs = sa.table("jobs", sa.column("id", sa.Integer), sa.column("state", sa.String(16)),
                sa.column("sweep_id", sa.Integer), sa.column("error", sa.JSON))


def _move(conn, old: str, new: str) -> None:
    """Sweep trials in state `old` whose error's class is "pruned" go to `new`. The class is read here, not
    in SQL: JSON paths differ between SQLite and PostgreSQL, and only sweeps' trials are read."""
    rows = conn.execute(sa.select(jobs.c.id, jobs.c.error).where(jobs.c.state == old, jobs.c.sweep_id.is_not(None)))
    ids = [r.id for r in rows if isinstance(r.error, dict) and r.error.get("class") == "pruned"]
    for i in range(0, len(ids), 500):
        conn.execute(sa.update(jobs).where(jobs.c.id.in_(ids[i:i + 500]), jobs.c.state == old).values(state=new))


def upgrade() -> None:
    _move(op.get_bind(), "failed", "pruned")


def downgrade() -> None:
    _move(op.get_bind(), "pruned", "failed")
