"""A run whose lease lapses is stopped at the lapse, whatever its supervisor is waiting on; and connections
to PostgreSQL carry libpq's limits, so no call waits for minutes on a network that is gone. The whole
thing, a host's link cut for real, is tests/test_hosts_netns.py."""
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from bench.common import postgres_schema
from trainyard.app.db import PG_CONNECTION_LIMITS, make_engine
from trainyard.worker.supervise import LeaseWatch


def job_process() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def run_of(proc: subprocess.Popen, calling_since: float | None) -> SimpleNamespace:
    """A JobRun as LeaseWatch sees it: its start, its process, and its worker's call to the database."""
    return SimpleNamespace(started=time.monotonic(), job=SimpleNamespace(id=7), proc=proc,
                           worker=SimpleNamespace(db_waiting_since=calling_since))


def test_a_lease_that_lapses_while_the_database_cannot_be_reached_kills_the_job_process():
    proc = job_process()
    try:
        watch = LeaseWatch(run_of(proc, calling_since=time.monotonic()), lease_s=0.5)  # a call that hangs
        assert proc.wait(timeout=5) == -9
        assert watch.lapsed
    finally:
        proc.kill()


def test_a_loop_that_is_only_slow_keeps_its_job_process():
    """No call to the database is under way: the loop was starved of CPU, not cut off. Its next renewal
    reaches the database, which alone knows whether the job was taken over meanwhile."""
    proc = job_process()
    try:
        watch = LeaseWatch(run_of(proc, calling_since=None), lease_s=0.3)
        time.sleep(1.2)  # four leases
        assert proc.poll() is None and not watch.lapsed
        watch.close()
    finally:
        proc.kill()


def test_renewals_keep_the_job_process_and_closing_the_watch_stops_it_watching():
    proc = job_process()
    try:
        run = run_of(proc, calling_since=time.monotonic())
        watch = LeaseWatch(run, lease_s=0.5)
        for _ in range(15):  # 1.5 s, three leases long, each call answered in time
            time.sleep(0.1)
            watch.renewed(time.monotonic())
        assert proc.poll() is None and not watch.lapsed
        watch.close()
        time.sleep(0.8)
        assert proc.poll() is None and not watch.lapsed
    finally:
        proc.kill()


@pytest.mark.postgres
def test_postgresql_connections_carry_libpqs_limits_unless_the_url_sets_its_own():
    with postgres_schema("limits") as url:
        engine = make_engine(url + "&connect_timeout=3")
        try:
            with engine.connect() as conn:
                params = conn.connection.dbapi_connection.info.get_parameters()
        finally:
            engine.dispose()
    assert params["connect_timeout"] == "3"  # the URL's own
    for key in ("tcp_user_timeout", "keepalives_idle", "keepalives_interval", "keepalives_count"):
        assert params[key] == PG_CONNECTION_LIMITS[key], key
    assert "search_path" in params["options"] and "idle_in_transaction_session_timeout" in params["options"]
