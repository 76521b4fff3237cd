"""The same service on PostgreSQL (how several hosts share one queue), against the real server."""
import os

import psycopg
import pytest

from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.service import Service
from trainyard.app.launcher import postgres_schema

ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
APP = f"trainyard_failover_{os.getpid()}"
pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def pg_service(tmp_path):
    # Its sessions carry a name of their own: the failover test kills them, and no other test's (xdist runs
    # another test file beside this one, on the same database).
    with postgres_schema("svc") as url:
        svc = Service(tmp_path / "data", database_url=f"{url}&application_name={APP}").start_server()
        yield svc
        svc.stop()


def test_two_workers_on_postgres_run_each_job_once(pg_service):
    pg_service.start_worker("cpu")
    pg_service.start_worker("cpu")
    ids = [pg_service.submit(tiny_job(epochs=1))["id"] for _ in range(12)]
    jobs = [pg_service.wait_state(i, timeout=180) for i in ids]
    assert all(j["state"] == "succeeded" and j["runs"] == 1 for j in jobs), jobs
    assert len({j["worker_id"] for j in jobs}) == 2


def test_dropped_database_connections_do_not_lose_the_job(pg_service):
    """Every session of the service is killed by the database mid-training (as in a failover)."""
    pg_service.start_worker("cpu")
    job = pg_service.submit(slow_job(epochs=20))  # the sessions are killed while it trains, not after
    pg_service.wait_until(lambda: pg_service.job(job["id"])["progress"]["epoch"] >= 1, 120, "first epoch")
    with psycopg.connect(ADMIN, autocommit=True) as c:
        killed = c.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                           "WHERE application_name = %s", (APP,)).fetchone()[0]
    assert killed >= 1
    done = pg_service.wait_state(job["id"], timeout=240)
    assert done["state"] == "succeeded" and done["runs"] == 1, done
    with pg_service.client() as c:
        assert [m["epoch"] for m in c.get(f"/jobs/{job['id']}/metrics").json()] == list(range(1, 21))
    assert all(p.poll() is None for p in pg_service.workers)
