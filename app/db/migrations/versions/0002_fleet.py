"""A GPU fleet: jobs state their GPU memory and devices, workers drain and lend their devices.

Adds only nullable columns. A column already there is left alone: builds between the baseline and
migrations added some of these at start-up.

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

COLUMNS: dict[str, list[sa.Column]] = {
    "jobs": [sa.Column("need_gpu_memory", sa.BigInteger), sa.Column("gpu_key", sa.String(200)),
             sa.Column("devices", sa.Integer), sa.Column("ranks", sa.JSON)],
    "workers": [sa.Column("draining", sa.Boolean), sa.Column("lent_to", sa.Integer),
                sa.Column("lent_claim", sa.Integer)],
}


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    for table, columns in COLUMNS.items():
        have = {c["name"] for c in inspector.get_columns(table)}
        for column in columns:
            if column.name not in have:
                op.add_column(table, column)


def downgrade() -> None:
    for table, columns in COLUMNS.items():
        with op.batch_alter_table(table) as batch:
            for column in columns:
                batch.drop_column(column.name)
