"""The database: engine factory (SQLite pragmas, write transactions), the tables (app/db/tables.py, re-exported
here), and the database clock.

Everything here is dialect-neutral: the same tables and statements run on SQLite (the embedded
default) and PostgreSQL (several hosts sharing one queue).
"""
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Integer, any_, bindparam, create_engine, event
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.expression import FunctionElement
from sqlalchemy.types import Float as FloatType

from trainyard.app.db import wakeup
from trainyard.app.db.tables import (  # noqa: F401 (re-exported: the tables are imported from here)
    audit,
    counters,
    job_deps,
    job_sweeps,
    jobs,
    members,
    metadata,
    metrics,
    project_usage,
    projects,
    sessions,
    storage_usage,
    sweep_log,
    sweeps,
    tokens,
    users,
    workers,
)
from trainyard.app.db.tracking_tables import tracked_runs  # noqa: F401 (re-exported)


class db_now(FunctionElement):
    """The database server's clock in epoch seconds: leases must not depend on each host's clock."""
    type = FloatType()
    inherit_cache = True


@compiles(db_now, "sqlite")
def _sqlite_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"


@compiles(db_now, "postgresql")
def _pg_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"


# Longer than any transaction of ours takes (milliseconds), shorter than a test's patience.
IDLE_IN_TRANSACTION_MS = 10_000
# libpq's own limits on a connection to PostgreSQL, unless the URL sets them. Without them a process whose
# host lost its network waits on TCP's retransmissions (about 15 minutes) inside one call: a connection
# attempt gives up after connect_timeout, a write unacknowledged for tcp_user_timeout fails, and an idle
# connection (a LISTEN) whose peer is gone is found by keepalives within about 25 seconds.
PG_CONNECTION_LIMITS = {"connect_timeout": "10", "tcp_user_timeout": "15000", "keepalives": "1",
                        "keepalives_idle": "10", "keepalives_interval": "5", "keepalives_count": "3"}


def ids_in(column: ColumnElement[int], dialect: str, name: str = "ids") -> ColumnElement[bool]:
    """column IN the list of ids bound as `name`. On PostgreSQL one array parameter (`= ANY`): the statement's text
    is the same whatever the list's length, so psycopg parses it once and prepares it (an expanding IN of a page's
    50 ids made a statement too long for its cache, split again at every request). Elsewhere an expanding IN."""
    if dialect == "postgresql":
        return column == any_(bindparam(name, type_=ARRAY(Integer)))
    return column.in_(bindparam(name, expanding=True))


def compact_json(value: Any) -> str:
    """JSON columns as stored: without the spaces json.dumps puts after separators (they were a fifth of a
    stored row of numbers, a predict job's inputs)."""
    return json.dumps(value, separators=(",", ":"))


def make_engine(url: str, pre_ping: bool = True) -> Engine:
    """pre_ping: test each pooled PostgreSQL connection before use (a round trip), so that one the
    server dropped (a restart, a failover) is replaced rather than failing the next statement."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False},
                               pool_size=8, max_overflow=16, json_serializer=compact_json)
        configure_sqlite(engine)
    else:
        # A session left idle inside a transaction (its process frozen: SIGSTOP, a paused VM) is ended by
        # the server after this long, so the row locks it holds cannot hold the queue up for longer.
        parsed = make_url(url)  # options the URL sets (a search_path, say) are kept beside ours
        given = parsed.query.get("options")  # a tuple when the URL repeats it
        options = " ".join(filter(None, (*((given,) if isinstance(given, str) else given or ()),
                                         f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}")))
        # Kept in the URL (not connect_args), so that whoever connects with the engine's connect arguments
        # (wakeup's LISTEN connection: dialect.create_connect_args) lands in the same schema as the engine.
        limits = {k: v for k, v in PG_CONNECTION_LIMITS.items() if k not in parsed.query}
        engine = create_engine(parsed.update_query_dict({"options": options, **limits}), pool_size=8, max_overflow=16,
                               pool_pre_ping=pre_ping, json_serializer=compact_json)
    return engine


def configure_sqlite(engine: Engine, busy_ms: int = 30000, transactions: bool = True) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let us issue BEGIN ourselves, so writes can take the lock up front (BEGIN IMMEDIATE):
        # a deferred transaction that later upgrades to a writer can fail with "database is
        # locked" without waiting for the busy timeout.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    if not transactions:  # each statement its own transaction (and snapshot): reads of one row
        return

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        immediate = conn.get_execution_options().get("write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


@contextmanager
def write(engine: Engine) -> Iterator[Connection]:
    """A transaction that writes: takes SQLite's write lock at BEGIN; a plain transaction elsewhere.
    Idle workers it asked to wake (wakeup.notify) are woken once it has committed."""
    with engine.connect().execution_options(write=True) as conn:
        committed = False
        try:
            with conn.begin():
                yield conn
            committed = True
        finally:
            wakeup.after_commit(conn, committed)


@contextmanager
def read(engine: Engine) -> Iterator[Connection]:
    """Statements that only read. On PostgreSQL each is its own transaction (autocommit): no BEGIN and
    COMMIT round trips to the server; the reads that need one snapshot are single statements."""
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            yield conn.execution_options(isolation_level="AUTOCOMMIT")
            return
        with conn.begin():
            yield conn
