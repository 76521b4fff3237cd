"""The event-loop reader of GET /jobs/{id} and GET /jobs (app/api/reads.py): inline on SQLite, and off the loop
whenever the read would wait for a lock."""
import asyncio
import sqlite3
import threading
import time

import pytest
from sqlalchemy import text

from tests.helpers.jobs import tiny_job
from trainyard.app.api.reads import INLINE_BUSY_MS, LoopReader
from trainyard.app.db import make_engine, migrate
from trainyard.app.jobs import submit
from trainyard.app.launcher import PG_ADMIN, postgres_schema
from trainyard.app.records import job_reads
from trainyard.app.spec import parse_spec


def test_inline_read_and_a_locked_database_that_does_not_stall_the_loop(tmp_path):
    db = tmp_path / "q.db"
    engine = make_engine(f"sqlite:///{db}")
    migrate.upgrade(engine)
    job, _ = submit.enqueue(engine, parse_spec(tiny_job()))
    engine.dispose()

    # Another process holds an exclusive lock (which readers must wait for) for 0.5 s: the read gives
    # up inline after INLINE_BUSY_MS and waits in a thread, while the loop goes on serving.
    locker = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    locker.execute("PRAGMA locking_mode=EXCLUSIVE")
    locker.execute("BEGIN EXCLUSIVE")
    locker.execute("UPDATE jobs SET priority = 7")
    threading.Timer(0.5, lambda: (locker.execute("COMMIT"), locker.close())).start()
    reader = LoopReader(engine, f"sqlite:///{db}")

    async def read():
        return await reader.run(lambda engine: job_reads.get_job(engine, job.id))

    async def both():
        ticks, started = 0, time.monotonic()

        async def tick():
            nonlocal ticks
            while time.monotonic() - started < 0.4:
                await asyncio.sleep(0.01)
                ticks += 1
        found, _ = await asyncio.gather(read(), tick())
        return found, ticks, time.monotonic() - started

    found, ticks, took = asyncio.run(both())
    assert found.priority == 7 and took >= 0.45  # it waited for the lock and read the committed row
    assert ticks >= 0.4 / 0.01 / 2  # the loop was stalled at most INLINE_BUSY_MS, not 0.5 s
    assert INLINE_BUSY_MS <= 100
    # Unlocked, it reads inline what the thread-pool read reads.
    assert asyncio.run(read()) == job_reads.get_job(engine, job.id)
    reader.dispose()


@pytest.mark.postgres
def test_a_postgres_read_is_retried_once_when_the_server_dropped_its_connection():
    """The reader's pool does not ping connections before use (a round trip per read): a read on one
    the server has dropped (a restart, a failover) is retried on a fresh one instead of failing."""
    import psycopg
    with postgres_schema("reads") as url:
        engine = make_engine(url)
        migrate.upgrade(engine)
        job, _ = submit.enqueue(engine, parse_spec(tiny_job()))
        reader = LoopReader(engine, url)

        def read(e):
            return job_reads.get_job(e, job.id)
        assert asyncio.run(reader.run(read)) == job_reads.get_job(engine, job.id)
        with reader.engine.connect() as c:  # the pool's one connection, which the next read takes
            pid = c.execute(text("SELECT pg_backend_pid()")).scalar()
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]
        assert asyncio.run(reader.run(read)).id == job.id
        with reader.engine.connect() as c:
            assert c.execute(text("SELECT pg_backend_pid()")).scalar() != pid
        reader.dispose()
        engine.dispose()
