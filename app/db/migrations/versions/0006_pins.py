"""A job can be pinned (POST /jobs/{id}/pin): kept from deletion while a model it made is in use elsewhere.
Jobs of earlier releases are not pinned (NULL reads as false).

And, now that jobs and sweeps are deleted (app/lifecycle/deletion.py), SQLite never hands a deleted id out again: its
jobs
and sweeps tables become AUTOINCREMENT ones. Without it SQLite gives a new row the largest id + 1, so deleting
the newest job would give its id to the next one: a client's id would name another job, and a worker still fenced
by its claim on the old one could match the new one's row. PostgreSQL's sequences never reuse an id already.
SQLite adds AUTOINCREMENT only by copying the table; dropping the old copy would cascade into its children
(metrics, sweep_log: foreign keys are on, and cannot be turned off inside the migration's transaction), so their
rows are set aside and put back around the copy, their tables made again from their own stored SQL.

Revision ID: 0006
Revises: 0005
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def _copied(parent: str, child: str, autoincrement: bool, change=None) -> None:
    """SQLite: copy `parent` (AUTOINCREMENT or not, with `change` made to it in the copy), its child table's rows
    kept across. Elsewhere only the change."""
    conn = op.get_bind()
    if conn.dialect.name != "sqlite":
        if change is not None:
            with op.batch_alter_table(parent) as batch:
                change(batch)
        return
    made = [r[0] for r in conn.exec_driver_sql(
        "SELECT sql FROM sqlite_master WHERE tbl_name = ? AND sql IS NOT NULL ORDER BY type DESC", (child,))]
    conn.exec_driver_sql(f"CREATE TEMP TABLE kept_{child} AS SELECT * FROM {child}")
    conn.exec_driver_sql(f"DROP TABLE {child}")
    with op.batch_alter_table(parent, recreate="always", table_kwargs={"sqlite_autoincrement": autoincrement}) as batch:
        if change is not None:
            change(batch)
    for sql in made:  # the table first ("table" sorts after "index" descending), then its indexes
        conn.exec_driver_sql(sql)
    conn.exec_driver_sql(f"INSERT INTO {child} SELECT * FROM kept_{child}")
    conn.exec_driver_sql(f"DROP TABLE kept_{child}")


def upgrade() -> None:
    _copied("jobs", "metrics", True, lambda batch: batch.add_column(sa.Column("pinned", sa.Boolean)))
    _copied("sweeps", "sweep_log", True)


def downgrade() -> None:
    _copied("sweeps", "sweep_log", False)
    _copied("jobs", "metrics", False, lambda batch: batch.drop_column("pinned"))
