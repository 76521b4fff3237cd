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


def run_of(proc: subprocess.Popen) -> SimpleNamespace:
    return SimpleNamespace(started=time.monotonic(), job=SimpleNamespace(id=7), proc=proc)


def test_a_lease_that_lapses_kills_the_job_process():
    proc = job_process()
    try:
        watch = LeaseWatch(run_of(proc), lease_s=0.5)  # and never renewed: the database is out of reach
        assert proc.wait(timeout=5) == -9
        assert watch.lapsed
    finally:
        proc.kill()


def test_renewals_keep_the_job_process_and_closing_the_watch_stops_it_watching():
    proc = job_process()
    try:
        watch = LeaseWatch(run_of(proc), lease_s=0.5)
        for _ in range(15):  # 1.5 s, three leases long
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
