"""Databases made before migrations: brought to the baseline's schema before they are stamped with it.

Releases before Alembic made their tables with `create_all`, which never alters a table that exists,
and the tables changed from release to release: a database of release 617d61b lacks the baseline's
`parameters`, `need_model`, `need_dataset`, `need_entrypoint` and the index `ix_jobs_queued_device`,
one of the builds after the baseline has some of migration 0002's columns already (0002 leaves those
alone). Every column those releases lacked is nullable without a default, so adding it keeps every
row as it was (tests/fixtures/releases holds the database of each of them; test_release_upgrades.py
upgrades each). A database that lacks a table, or a column the baseline requires (NOT NULL), was made
by no release: it is refused, with what it lacks, rather than stamped.
"""
from types import ModuleType

from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, create_engine, inspect
from sqlalchemy.engine import Connection

FIRST_RELEASE = "617d61b"  # the first release: every release's database since upgrades


class SchemaBehind(RuntimeError):
    """The database's schema is older than this release's, and this process may not upgrade it."""


class SchemaUnknown(SchemaBehind):
    """A database without alembic_version whose tables no release of trainyard made: never stamped."""


def to_baseline(conn: Connection, baseline: ModuleType) -> list[str]:
    """Add to a pre-migration database what the baseline revision's schema has and it lacks, in conn's
    transaction: returns what was added ("jobs.parameters", "index ix_jobs_queued_device", ...)."""
    want = _schema_of(baseline)
    have = inspect(conn)
    lacking = [table for table in want if not have.has_table(table)]
    if lacking:
        raise SchemaUnknown(_refusal(f"no table {', '.join(lacking)}"))
    ops = Operations(MigrationContext.configure(conn))
    added: list[str] = []
    for table, (columns, indexes) in want.items():
        existing = {c["name"] for c in have.get_columns(table)}
        missing = [c for c in columns if c["name"] not in existing]
        required = [c["name"] for c in missing if not c["nullable"]]
        if required:
            raise SchemaUnknown(_refusal(f"no column {', '.join(f'{table}.{n}' for n in required)}"))
        for column in missing:
            ops.add_column(table, Column(column["name"], column["type"], nullable=True))
            added.append(f"{table}.{column['name']}")
        have_indexes = {i["name"] for i in have.get_indexes(table)}
        for index in indexes:
            if index["name"] not in have_indexes:
                ops.create_index(index["name"], table, index["column_names"], unique=bool(index["unique"]))
                added.append(f"index {index['name']}")
    return added


def _schema_of(baseline: ModuleType) -> dict[str, tuple[list, list]]:
    """The baseline's tables as its own upgrade() builds them: {table: (columns, indexes)}, read back
    from a scratch in-memory SQLite database (the types come back generic: BIGINT, VARCHAR(100), JSON)."""
    scratch = create_engine("sqlite://")
    try:
        with scratch.begin() as conn:
            with Operations.context(MigrationContext.configure(conn)):
                baseline.upgrade()
            found = inspect(conn)
            return {t: (found.get_columns(t), found.get_indexes(t)) for t in found.get_table_names()}
    finally:
        scratch.dispose()


def _refusal(what: str) -> str:
    return (f"the database has tables but no alembic_version, and {what}: no release of trainyard since "
            f"{FIRST_RELEASE} made it, so it is not upgraded; restore a backup made by a trainyard release, "
            f"or start from an empty database")
