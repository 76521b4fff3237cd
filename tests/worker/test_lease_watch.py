"""A run whose lease lapses is stopped at the lapse, whatever its supervisor is waiting on; and connections
to PostgreSQL carry libpq's limits, so no call waits for minutes on a network that is gone. The whole
thing, a host's link cut for real, is tests/worker/test_hosts_netns.py."""
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from trainyard.app.db import PG_CONNECTION_LIMITS, make_engine
from trainyard.app.launcher import postgres_schema
from trainyard.worker.supervisor.supervise import LeaseWatch


def job_process() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def run_of(proc: subprocess.Popen, calling_since: float | None) -> SimpleNamespace:
    """A JobRun as LeaseWatch sees it: its start, its process, and its worker's call to the database."""
    return SimpleNamespace(started=time.monotonic(), job=SimpleNamespace(id=7), proc=proc,
                           worker=SimpleNamespace(network_call_since=calling_since))


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


def test_a_log_upload_hanging_past_the_lease_is_a_cut_off_too():
    """A host cut off in the middle of its log's upload to the bucket (JobRun.publish_log, every heartbeat): the
    supervisor waits in botocore, not in the database, and its job process must still stop at the lapse. A claim
    check made inside the upload (a database call within it) keeps the upload's start."""
    from trainyard.worker.supervisor.main import Worker
    proc = job_process()
    try:
        worker = SimpleNamespace(network_call_since=None)
        run = SimpleNamespace(started=time.monotonic(), job=SimpleNamespace(id=7), proc=proc, worker=worker)
        watch = LeaseWatch(run, lease_s=0.5)
        with Worker.on_the_network(worker):  # the upload, to a bucket gone with the link
            with Worker.on_the_network(worker):  # the claim check inside it, answered
                pass
            assert worker.network_call_since is not None
            assert proc.wait(timeout=5) == -9
        assert watch.lapsed and worker.network_call_since is None
    finally:
        proc.kill()
