"""Accounts hardened: tokens.expires_at (when a token stops working; NULL: never, as every token of earlier
releases), and sessions, the dashboard's sign-ins (its cookie held the token itself before: those cookies now
sign no one in, and the page asks for the token again).

Revision ID: 0011
Revises: 0010
"""
import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tokens", sa.Column("expires_at", sa.Float))
    op.create_table(
        "sessions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("digest", sa.String(64), nullable=False, unique=True),
        sa.Column("token_digest", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_sessions_token_digest", "sessions", ["token_digest"])


def downgrade() -> None:
    op.drop_index("ix_sessions_token_digest", table_name="sessions")
    op.drop_table("sessions")
    # Plain DROP COLUMN (SQLite 3.35+): a batch copy of tokens is not needed for a column without constraints.
    op.execute("ALTER TABLE tokens DROP COLUMN expires_at")
