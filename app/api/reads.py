"""Reads on the event loop: the hottest endpoint (GET /jobs/{id}, what every client polls) reads the
database without a trip through the thread pool, which cost more CPU than the read itself.

SQLite: the read runs inline, on a connection of its own that only the event loop uses. In WAL mode
a reader never waits for a writer, so it takes tens of microseconds; for the rare case where it would
wait (a WAL being reset), its busy timeout is short and the read goes to the thread pool instead.
PostgreSQL: the read takes the thread pool, on the app's engine: it waits on the network, and an
async connection (psycopg's, through SQLAlchemy's asyncio extension) measured no cheaper than the hop.
"""
from sqlalchemy import Row, Select, create_engine
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import StaticPool
from starlette.concurrency import run_in_threadpool

from trainyard.app.db import configure_sqlite

# How long an inline SQLite read may wait for a lock before it leaves the loop (ms).
INLINE_BUSY_MS = 50


class LoopReader:
    """Beside the app's engine (which every other route uses, in the thread pool), and falling back to it."""

    def __init__(self, fallback: Engine):
        self.fallback = fallback
        self.sqlite = fallback.dialect.name == "sqlite"
        if self.sqlite:
            self.engine = create_engine(fallback.url, poolclass=StaticPool, connect_args={
                "check_same_thread": False, "timeout": INLINE_BUSY_MS / 1000})
            configure_sqlite(self.engine, busy_ms=INLINE_BUSY_MS, transactions=False)

    async def first(self, stmt: Select) -> Row | None:
        if not self.sqlite:
            return await run_in_threadpool(self._first_blocking, stmt)
        try:
            with self.engine.connect() as conn:  # one statement, one snapshot: no BEGIN/COMMIT of its own
                return conn.execute(stmt).first()
        except OperationalError:  # it would have waited for a lock: wait in a thread instead
            return await run_in_threadpool(self._first_blocking, stmt)

    def _first_blocking(self, stmt: Select) -> Row | None:
        with self.fallback.connect() as conn, conn.begin():
            return conn.execute(stmt).first()

    def dispose(self) -> None:
        if self.sqlite:
            self.engine.dispose()
