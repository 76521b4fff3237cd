"""Jobs on several devices through the real service: CPU workers lend their devices to a job's ranks;
kill, SIGTERM and cancel stop every rank, and the job resumes from its checkpoint."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.backends import on_both_backends, on_postgres_only, on_sqlite_only
from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.processes import alive, all_gone, job_pids, rank_pids
from tests.helpers.service import metrics, wait_checkpoint

pytestmark = pytest.mark.slow  # starts the real server and workers
service_backend = on_both_backends()


def workers_by_id(service) -> dict[str, dict]:
    with service.client() as c:
        return {w["id"]: w for w in c.get("/workers").json()}


def two_device_job(**train) -> dict:
    return {**slow_job(**train), "devices": 2}


def running_on_two(service, job_id, run: int = 1) -> dict:
    service.wait_until(lambda: service.job(job_id)["state"] == "running" and service.job(job_id)["runs"] == run
                       and len(rank_pids(service, job_id)) == run, 60, f"run {run} of job {job_id} on two ranks")
    return service.job(job_id)


def test_a_two_device_job_runs_on_two_workers_and_its_model_is_a_plain_one(service):
    service.start_worker("cpu")
    service.start_worker("cpu")
    job = service.submit(two_device_job(epochs=6))
    running = running_on_two(service, job["id"])
    assert [r["device"] for r in running["ranks"]] == ["cpu", "cpu"]
    lent = {r["worker"] for r in running["ranks"]}
    # Both workers show the job, the lent one included (/workers, dashboard).
    service.wait_until(lambda: {w["id"] for w in workers_by_id(service).values() if w["job_id"] == job["id"]} == lent,
                       10, "both workers to show the job")
    done = service.wait_state(job["id"], timeout=240)
    assert done["state"] == "succeeded", done
    assert done["result"]["devices"] == 2 and done["result"]["val_accuracy"] > 0.5
    assert [m["epoch"] for m in metrics(service, job["id"])] == list(range(1, 7))
    assert all_gone(rank_pids(service, job["id"]) + job_pids(service, job["id"]), 10)
    listing = subprocess.run([sys.executable, "-m", "trainyard", "jobs", "--url", service.url], capture_output=True,
                             text=True, env={**os.environ, "COLUMNS": "160"}, timeout=60)
    assert "cpu + cpu" in listing.stdout, listing.stdout  # the CLI shows each rank's device
    # The artifact is a plain single-device model: a predict job loads it on one worker.
    pred = service.submit({"kind": "predict", "model_job": job["id"], "data": {"dataset": "digits"}, "device": "cpu"})
    got = service.wait_state(pred["id"])
    assert got["state"] == "succeeded" and got["result"]["accuracy"] == pytest.approx(done["result"]["val_accuracy"])


def test_sigkill_of_the_leading_worker_stops_every_rank_and_the_job_resumes(service):
    service.start_worker("cpu")
    service.start_worker("cpu")
    job = service.submit(two_device_job(epochs=16))
    running_on_two(service, job["id"])
    before = wait_checkpoint(service, job["id"], 2)
    leader = workers_by_id(service)[before["ranks"][0]["worker"]]
    pids = rank_pids(service, job["id"]) + job_pids(service, job["id"])
    os.kill(leader["pid"], signal.SIGKILL)
    killed_at = service.job(job["id"])["checkpoint_epoch"]
    # The job process notices its supervisor is gone at its next report; its ranks die with it.
    assert all_gone(pids, 30), [p for p in pids if alive(p)]
    service.start_worker("cpu")  # the survivor and a newcomer take it over once the lease runs out
    done = service.wait_state(job["id"], timeout=240)
    assert done["state"] == "succeeded", done
    assert done["runs"] == 2 and done["errors"][0]["type"] == "LeaseExpired"
    assert done["result"]["resumed_from_epoch"] >= killed_at >= 2
    assert leader["id"] not in {r["worker"] for r in done["ranks"]}
    assert [m["epoch"] for m in metrics(service, job["id"])] == list(range(1, 17))


@on_postgres_only
def test_sigterm_checkpoints_every_rank_and_requeues_then_cancel_stops_them(service):
    service.start_worker("cpu")
    service.start_worker("cpu")
    job = service.submit(two_device_job(epochs=40))
    running = running_on_two(service, job["id"])
    wait_checkpoint(service, job["id"], 1)
    pids = rank_pids(service, job["id"]) + job_pids(service, job["id"])
    leader = workers_by_id(service)[running["ranks"][0]["worker"]]
    os.kill(leader["pid"], signal.SIGTERM)
    queued = service.wait_state(job["id"], states=("queued",), timeout=30)
    assert queued["attempt"] == 0, queued  # a graceful stop uses no attempt
    assert all_gone(pids, 10)
    with service.client() as c:
        assert "checkpointed at a step boundary" in c.get(f"/jobs/{job['id']}/logs").text

    service.start_worker("cpu")
    running_on_two(service, job["id"], run=2)
    service.wait_until(lambda: (service.job(job["id"])["latest_metrics"] or {}).get("epoch", 0)
                       > queued["checkpoint_epoch"], 60, "the resumed run to report an epoch")
    pids = rank_pids(service, job["id"])[-1:] + job_pids(service, job["id"])[-1:]
    with service.client() as c:
        assert c.post(f"/jobs/{job['id']}/cancel").status_code == 200
    started = time.monotonic()
    assert all_gone(pids, 5) and time.monotonic() - started < 3
    # Both devices are free again: two one-device jobs run side by side.
    small = [service.submit(tiny_job(epochs=2)) for _ in range(2)]
    assert all(service.wait_state(s["id"])["state"] == "succeeded" for s in small)
    assert service.job(job["id"])["state"] == "cancelled"


@on_sqlite_only
def test_a_two_device_job_behind_a_stream_of_one_device_jobs_starts_before_those_after_it(service):
    service.start_worker("cpu")
    service.start_worker("cpu")
    before = [service.submit(slow_job(epochs=3)) for _ in range(4)]
    wide = service.submit({**tiny_job(epochs=2), "devices": 2})
    after = [service.submit(slow_job(epochs=3)) for _ in range(4)]
    done = {j["id"]: service.wait_state(j["id"], timeout=240) for j in before + [wide] + after}
    assert all(d["state"] == "succeeded" for d in done.values()), done
    start = {i: d["started_at"] for i, d in done.items()}
    # Devices are reserved for the head of the line as they free up: nothing submitted after it overtakes it.
    assert all(start[wide["id"]] <= start[j["id"]] for j in after)
    assert done[wide["id"]]["result"]["devices"] == 2
