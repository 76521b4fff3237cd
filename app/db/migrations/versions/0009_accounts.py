"""Accounts: users in projects, their tokens (stored as SHA-256 digests), the audit record, the project and
owner of each job and sweep, what each project stores (project_usage), and a job's preemption request. Jobs and
sweeps of earlier releases belong to no project: admins see them.

Revision ID: 0009
Revises: 0008
"""
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("jobs", "sweeps"):
        op.add_column(table, sa.Column("project_id", sa.Integer))
        op.add_column(table, sa.Column("owner", sa.String(100)))
        op.create_index(f"ix_{table}_project_id", table, ["project_id"])
    op.add_column("jobs", sa.Column("preempt_requested_at", sa.Float))
    op.create_table(
        "project_usage",
        sa.Column("project_id", sa.Integer, primary_key=True),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("objects", sa.BigInteger, nullable=False),
        sa.Column("measured_at", sa.Float, nullable=False),
    )
    op.create_table(
        "projects",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(100), nullable=False, unique=True),
        sa.Column("share", sa.Float, nullable=False),
        sa.Column("limits", sa.JSON),
        sa.Column("created_at", sa.Float, nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "users",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(100), nullable=False, unique=True),
        sa.Column("admin", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "members",
        sa.Column("user_id", sa.Integer, sa.ForeignKey("users.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("project_id", sa.Integer, sa.ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("digest", sa.String(64), nullable=False, unique=True),
        sa.Column("user_id", sa.Integer, sa.ForeignKey("users.id", ondelete="CASCADE"), nullable=False),
        sa.Column("project_id", sa.Integer, sa.ForeignKey("projects.id", ondelete="CASCADE")),
        sa.Column("label", sa.String(200)),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("revoked_at", sa.Float),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_tokens_user_id", "tokens", ["user_id"])
    op.create_table(
        "audit",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("actor", sa.String(100), nullable=False),
        sa.Column("project", sa.String(100)),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("target", sa.String(200)),
        sa.Column("detail", sa.JSON),
        sa.Column("client", sa.String(100)),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_audit_action", "audit", ["action"])


def downgrade() -> None:
    op.drop_table("project_usage")
    op.execute("ALTER TABLE jobs DROP COLUMN preempt_requested_at")
    op.drop_index("ix_audit_action", table_name="audit")
    op.drop_table("audit")
    op.drop_index("ix_tokens_user_id", table_name="tokens")
    for table in ("tokens", "members", "users", "projects"):
        op.drop_table(table)
    for table in ("sweeps", "jobs"):
        op.drop_index(f"ix_{table}_project_id", table_name=table)
        # Plain DROP COLUMN (SQLite 3.35+): a batch copy would cascade into the child tables (see 0006).
        op.execute(f"ALTER TABLE {table} DROP COLUMN owner")
        op.execute(f"ALTER TABLE {table} DROP COLUMN project_id")
