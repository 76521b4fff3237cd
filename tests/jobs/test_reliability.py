"""Damage done for real: workers SIGKILLed, SIGSTOPped, SIGTERMed, jobs cancelled and timed out."""
import os
import re
import signal
import sqlite3
import threading
import time

import pytest

from tests.helpers.backends import on_both_backends, on_postgres_only, on_sqlite_only
from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.processes import alive, job_pids
from tests.helpers.service import Service, metrics, wait_checkpoint

pytestmark = pytest.mark.slow  # starts the real server and workers
service_backend = on_both_backends()


def test_sigkill_worker_job_resumes_on_another_worker(service):
    a = service.start_worker("cpu")
    job = service.submit(slow_job(epochs=20))  # the kill lands in epochs 3-19: over a second, even on a fast machine
    before = wait_checkpoint(service, job["id"], 2)
    os.kill(a.pid, signal.SIGKILL)
    killed_at = service.job(job["id"])["checkpoint_epoch"]
    assert killed_at >= before["checkpoint_epoch"]
    service.start_worker("cpu")
    done = service.wait_state(job["id"], timeout=240)
    assert done["state"] == "succeeded", done
    assert done["attempt"] == 2 and done["runs"] == 2
    assert done["errors"][0]["class"] == "infrastructure" and done["errors"][0]["type"] == "LeaseExpired"
    resumed = done["result"]["resumed_from_epoch"]
    assert resumed is not None and resumed >= killed_at
    history = metrics(service, job["id"])
    assert [m["epoch"] for m in history] == list(range(1, 21))  # no gap, no duplicate
    # The epochs before the checkpoint were not run again: their records are the first attempt's.
    assert {m["attempt"] for m in history if m["epoch"] <= resumed} == {1}
    assert {m["attempt"] for m in history if m["epoch"] > resumed} == {2}


def pause(service, pid: int) -> None:
    """SIGSTOP the worker. On SQLite, not in the middle of one of its (millisecond) write transactions:
    SQLite has one writer at a time, and a process frozen while it holds the write lock holds it until
    it resumes (a limit of the embedded database the README states). On PostgreSQL anywhere: the
    server ends a session left idle inside a transaction (idle_in_transaction_session_timeout), so a
    frozen worker's row locks cannot hold the queue up. What this test is about, fencing, does not
    depend on where the worker stops."""
    if service.backend == "postgres":
        os.kill(pid, signal.SIGSTOP)
        return
    db = service.data_dir / "trainyard.db"
    for _ in range(50):
        os.kill(pid, signal.SIGSTOP)
        try:
            conn = sqlite3.connect(db, timeout=1.0, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("ROLLBACK")
            finally:
                conn.close()
            return
        except sqlite3.OperationalError:  # it stopped holding the lock: let it finish, try again
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.05)
    raise AssertionError("the worker always held the write lock")


def test_sigstop_worker_loses_lease_and_its_late_writes_change_nothing(service):
    a = service.start_worker("cpu")
    job = service.submit(slow_job(epochs=20))
    wait_checkpoint(service, job["id"], 1)
    first_pid = job_pids(service, job["id"])[0]
    pause(service, a.pid)
    try:
        b = service.start_worker("cpu")
        service.wait_until(lambda: service.job(job["id"])["runs"] == 2, 60, "the second worker to take the job")
        taken = service.job(job["id"])
        assert taken["state"] == "running" and f"-{a.pid}-" not in taken["worker_id"]
    finally:
        os.kill(a.pid, signal.SIGCONT)
    # The first worker wakes up, finds the job is no longer its own and stops its copy.
    service.wait_until(lambda: not alive(first_pid), 10, "the stale job process to be stopped")
    done = service.wait_state(job["id"], timeout=240)
    assert done["state"] == "succeeded" and done["runs"] == 2
    assert f"-{b.pid}-" in done["worker_id"]
    history = metrics(service, job["id"])
    assert [m["epoch"] for m in history] == list(range(1, 21))
    assert history[-1]["attempt"] == 2
    with service.client() as c:
        meta = c.get(f"/jobs/{job['id']}/artifact", params={"format": "meta"})
        assert meta.status_code == 200
        assert "no longer ours" in c.get(f"/jobs/{job['id']}/logs").text
    assert done["result"]["val_accuracy"] == history[-1]["val_accuracy"]
    assert a.poll() is None  # the paused worker survived and goes on serving


@on_postgres_only
def test_sigterm_requeues_without_using_an_attempt(service):
    a = service.start_worker("cpu")
    job = service.submit(slow_job(epochs=20))
    wait_checkpoint(service, job["id"], 1)
    os.kill(a.pid, signal.SIGTERM)
    assert a.wait(timeout=30) == 0
    back = service.job(job["id"])
    assert back["state"] == "queued" and back["attempt"] == 0 and back["runs"] == 1
    service.start_worker("cpu")
    done = service.wait_state(job["id"], timeout=240)
    assert done["state"] == "succeeded" and done["attempt"] == 1 and done["runs"] == 2
    assert done["result"]["resumed_from_epoch"] is not None
    assert [m["epoch"] for m in metrics(service, job["id"])] == list(range(1, 21))


@on_sqlite_only
def test_cancel_running_job_stops_its_process_and_worker_goes_on(service):
    service.start_worker("cpu")
    job = service.submit(slow_job(epochs=30))
    service.wait_until(lambda: service.job(job["id"])["progress"]["epoch"] >= 1, 120, "first epoch")
    pid = job_pids(service, job["id"])[0]
    t0 = time.monotonic()
    with service.client() as c:
        r = c.post(f"/jobs/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    service.wait_until(lambda: not alive(pid), 2.0, "the cancelled job's process to exit")
    assert time.monotonic() - t0 < 2.5
    nxt = service.wait_state(service.submit(tiny_job())["id"], timeout=60)
    assert nxt["state"] == "succeeded"
    final = service.job(job["id"])
    assert final["state"] == "cancelled" and final["error"]["class"] == "cancelled"


@on_sqlite_only
def test_retry_resumes_a_cancelled_job_from_its_checkpoint(service):
    service.start_worker("cpu")
    job = service.submit(slow_job(epochs=16))
    at = wait_checkpoint(service, job["id"], 2)["checkpoint_epoch"]
    with service.client() as c:
        assert c.post(f"/jobs/{job['id']}/cancel").status_code == 200
        again = c.post(f"/jobs/{job['id']}/retry")
        assert again.status_code == 200 and again.json()["state"] == "queued"
    done = service.wait_state(job["id"], timeout=240)
    assert done["state"] == "succeeded"
    assert done["result"]["resumed_from_epoch"] >= at
    assert [e["class"] for e in done["errors"]] == ["cancelled"]
    assert [m["epoch"] for m in metrics(service, job["id"])] == list(range(1, 17))


@on_sqlite_only
def test_timeout_fails_the_job(service):
    service.start_worker("cpu")
    job = service.submit({**slow_job(epochs=200), "timeout_s": 2})
    done = service.wait_state(job["id"], timeout=60)
    assert done["state"] == "failed" and done["error"]["class"] == "timeout"
    assert "timeout_s" in done["error"]["message"] and done["attempt"] == 1


@on_sqlite_only
def test_diverging_loss_fails_with_the_reason(service):
    service.start_worker("cpu")
    job = service.submit({**tiny_job(), "model": {"arch": "mlp", "hidden": [256, 256, 256]},
                          "train": {"epochs": 20, "batch_size": 8, "optimizer": "sgd", "lr": 10.0, "momentum": 0.99}})
    done = service.wait_state(job["id"], timeout=60)
    assert done["state"] == "failed" and done["error"]["class"] == "job"
    assert re.search(r"loss became (nan|inf)", done["error"]["message"])
    assert done["attempt"] == 1 and len(done["errors"]) == 1  # not retried


@on_postgres_only
def test_four_workers_drain_200_jobs_while_the_api_is_busy(service: Service) -> None:
    for _ in range(4):
        service.start_worker("cpu")
    failures: list[str] = []
    ids: list[int] = []
    stop = threading.Event()

    def submitter(n):
        with service.client() as c:
            for _ in range(n):
                r = c.post("/jobs", json=tiny_job(epochs=1))
                if r.status_code != 201:
                    failures.append(r.text)
                else:
                    ids.append(r.json()["id"])

    def reader():
        with service.client() as c:
            while not stop.is_set():
                for path in ("/jobs?limit=50", "/devices", "/workers", f"/jobs/{ids[-1] if ids else 1}"):
                    r = c.get(path)
                    if r.status_code not in (200, 404):
                        failures.append(f"{path}: {r.status_code} {r.text}")

    readers = [threading.Thread(target=reader) for _ in range(2)]
    submitters = [threading.Thread(target=submitter, args=(50,)) for _ in range(4)]
    for t in readers + submitters:
        t.start()
    for t in submitters:
        t.join()
    try:
        with service.client() as c:
            service.wait_until(lambda: c.get("/jobs", params={"state": "succeeded", "limit": 1}).json()["count"] == 200,
                               600, "200 jobs to succeed")
    finally:
        stop.set()
        for t in readers:
            t.join()
    assert failures == []
    with service.client() as c:
        jobs = c.get("/jobs", params={"limit": 500}).json()["data"]
    assert sorted(j["id"] for j in jobs) == sorted(ids) and len(ids) == 200
    assert all(j["state"] == "succeeded" and j["runs"] == 1 and j["attempt"] == 1 for j in jobs)
    assert len({j["worker_id"] for j in jobs}) == 4
    logs = "".join((service.data_dir / "logs" / f"{i}.log").read_text() for i in ids)
    assert logs.count("job process pid") == 200  # each job ran exactly once


@on_postgres_only
@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_sigint_is_a_graceful_stop_too(service, sig):
    a = service.start_worker("cpu")
    job = service.submit(slow_job(epochs=20))
    wait_checkpoint(service, job["id"], 1)
    os.kill(a.pid, sig)
    assert a.wait(timeout=30) == 0
    back = service.job(job["id"])
    assert back["state"] == "queued" and back["attempt"] == 0


@on_sqlite_only
def test_a_checkpoint_that_cannot_be_read_starts_the_job_over_with_one_history(service):
    """The database points at a checkpoint its new worker cannot read (a lost disk, a host that never
    had it): the job starts over from epoch 1, says so, and keeps no metrics of the earlier run."""
    a = service.start_worker("cpu")
    job = service.submit(slow_job(epochs=16))
    before = wait_checkpoint(service, job["id"], 2)
    os.kill(a.pid, signal.SIGKILL)
    for f in (service.data_dir / "checkpoints" / str(job["id"])).glob("*"):
        f.unlink()  # every checkpoint file of the job is gone
    service.start_worker("cpu")
    done = service.wait_state(job["id"], timeout=240)
    assert done["state"] == "succeeded" and done["runs"] == 2, done
    assert done["result"]["resumed_from_epoch"] is None
    history = metrics(service, job["id"])
    assert [m["epoch"] for m in history] == list(range(1, 17)) and {m["attempt"] for m in history} == {2}
    with service.client() as c:
        log = c.get(f"/jobs/{job['id']}/logs").text
    assert "could not be read (it does not exist): starting over from epoch 1" in log, log
    assert before["checkpoint_epoch"] >= 2
