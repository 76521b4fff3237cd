"""The reads of the endpoints clients poll (GET /jobs/{id}, GET /jobs). On SQLite they run on the event
loop itself, without a trip through the thread pool, which cost more CPU than a read of one job, and
whose threads contended with the loop for the GIL while a page of jobs was built.

SQLite: the read runs inline, on a connection of its own that only the event loop uses, each statement
its own transaction. In WAL mode a reader never waits for a writer, so a read takes what its Python
takes (a fraction of a millisecond for a job, about two for a page of fifty); for the rare case where
it would wait (a WAL being reset), its busy timeout is short and the read goes to the thread pool.
PostgreSQL: the read takes the thread pool (it waits on the network; an async connection, psycopg's
through SQLAlchemy's asyncio extension, measured no cheaper than the hop), on a pool of its own that
does not ping each connection before use: a read is retried once on a fresh connection instead when
the server has dropped the one it took (a restart, a failover), which costs a round trip only then.
"""
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import create_engine
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.pool import StaticPool
from starlette.concurrency import run_in_threadpool

from trainyard.app.db import configure_sqlite, make_engine

# How long an inline SQLite read may wait for a lock before it leaves the loop (ms).
INLINE_BUSY_MS = 50
T = TypeVar("T")


class LoopReader:
    """Beside the app's engine (which every other route uses, in the thread pool), and falling back to it."""

    def __init__(self, fallback: Engine, url: str):
        self.fallback = fallback
        self.sqlite = fallback.dialect.name == "sqlite"
        if self.sqlite:
            self.engine = create_engine(url, poolclass=StaticPool, connect_args={
                "check_same_thread": False, "timeout": INLINE_BUSY_MS / 1000})
            configure_sqlite(self.engine, busy_ms=INLINE_BUSY_MS, transactions=False)
        else:
            self.engine = make_engine(url, pre_ping=False)

    async def run(self, read: Callable[[Engine], T]) -> T:
        """read(engine): only reads. Inline on SQLite; in the thread pool where it would wait."""
        if self.sqlite:
            try:
                return read(self.engine)
            except OperationalError:  # it would have waited for a lock: wait in a thread instead
                return await run_in_threadpool(read, self.fallback)
        return await run_in_threadpool(self._retrying, read)

    def _retrying(self, read: Callable[[Engine], T]) -> T:
        try:
            return read(self.engine)
        except DBAPIError as exc:
            if not exc.connection_invalidated:  # not a dropped connection: the read's own error
                raise
            return read(self.engine)  # the pool let go of the dropped connections: a fresh one

    def dispose(self) -> None:
        self.engine.dispose()
