"""The fleet with real worker processes: draining over HTTP (it finishes what it runs, claims nothing more,
shows as draining, takes jobs again once undrained), hosts sharing one database, one device's memory
shared by workers, and workers that cannot use their device (unavailable, saying why; their jobs wait
or are retried elsewhere, never failed)."""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers.backends import on_both_backends, on_postgres_only, on_sqlite_only
from tests.helpers.jobs import slow_job, tiny_job
from trainyard.app.core.settings import Settings
from trainyard.app.db import make_engine, migrate
from trainyard.app.fleet import workers as registry
from trainyard.app.jobs import queue, submit
from trainyard.app.records import job_reads
from trainyard.app.spec import parse_spec
from trainyard.worker.fork_server import mp_context
from trainyard.worker.supervisor.main import Worker

pytestmark = pytest.mark.slow
service_backend = on_both_backends()


@on_postgres_only
def test_drain_lets_the_running_job_finish_then_claims_nothing_until_undrain(service):
    service.start_worker("cpu")
    with service.client() as c:
        [worker] = c.get("/workers").json()
        running = service.submit(slow_job(epochs=20))  # a second or more: the drain lands while it runs
        service.wait_state(running["id"], "running")
        r = c.post(f"/workers/{worker['id']}/drain")
        assert r.status_code == 200 and r.json()["draining"] is True and r.json()["id"] == worker["id"]
        assert c.get(f"/jobs/{running['id']}").json()["state"] == "running"
        waiting = service.submit(tiny_job())
        assert service.wait_state(running["id"])["state"] == "succeeded"  # what it ran, it finishes
        time.sleep(2)  # an idle worker polls every 20 ms: it would have taken the job by now
        assert c.get(f"/jobs/{waiting['id']}").json()["state"] == "queued"
        [listed] = c.get("/workers").json()
        assert listed["draining"] is True and listed["state"] == "idle"  # alive, heartbeating, not claiming
        devices = c.get("/devices").json()
        assert devices["cpu"]["workers"][0]["draining"] is True

        # The CLI, as an operator would use it.
        cli = subprocess.run([sys.executable, "-m", "trainyard", "undrain", worker["id"], "--json",
                              "--url", service.url], capture_output=True, text=True, timeout=30)
        assert cli.returncode == 0 and json.loads(cli.stdout)["draining"] is False, cli.stderr
        assert service.wait_state(waiting["id"], timeout=30)["state"] == "succeeded"


@on_postgres_only
def test_drain_names_what_is_wrong(service):
    with service.client() as c:
        r = c.post("/workers/no-such-worker/drain")
        assert r.status_code == 404 and "no-such-worker" in r.json()["detail"]
        r = c.post(f"/workers/{'x' * 201}/undrain")
        assert r.status_code == 422
    cli = subprocess.run([sys.executable, "-m", "trainyard", "drain", "no-such-worker", "--url", service.url],
                         capture_output=True, text=True, timeout=30)
    assert cli.returncode == 1 and "no-such-worker" in cli.stderr


def test_devices_group_two_hosts_workers_sharing_one_database(service):
    """Two machines' workers (told apart by TRAINYARD_NODE_NAME, as containers on two hosts would be)
    against one server: /devices, /workers and /metrics put each under its own host."""
    for node in ("host-a", "host-b"):
        service.start_worker("cpu", env={"TRAINYARD_NODE_NAME": node})
    with service.client() as c:
        workers = c.get("/workers").json()
        assert sorted(w["host"] for w in workers) == ["host-a", "host-b"]
        assert all(w["id"].startswith(w["host"] + "-") for w in workers)
        devices = c.get("/devices").json()
        by_host = {h["host"]: h for h in devices["hosts"]}
        assert {"host-a", "host-b"} <= set(by_host)
        for node in ("host-a", "host-b"):
            cpu = by_host[node]["cpu"]
            assert [w["host"] for w in cpu["workers"]] == [node] and cpu["cores"] >= 1 and cpu["memory_total"] > 0
        assert devices["hosts"][0]["host"] not in ("host-a", "host-b")  # the API's own host comes first
        metrics = c.get("/metrics").text
        for node in ("host-a", "host-b"):
            assert f'trainyard_workers_alive{{device="cpu",host="{node}"}} 1.0' in metrics


def test_workers_share_one_device_budget_and_a_job_too_big_for_any_says_why(service):
    """Three real CPU workers offered one 10 GB device (TRAINYARD_DEVICE_MEMORY_GB, as workers on one
    GPU share its memory): 6 GB and 3 GB jobs run side by side, the next 6 GB job waits for memory
    though a worker is idle, and a 20 GB job says why it cannot start."""
    env = {"TRAINYARD_DEVICE_MEMORY_GB": "10"}
    for _ in range(3):
        service.start_worker("cpu", wait=False, env=env)
    service.wait_until(lambda: len(service.client().get("/workers").json()) == 3, 180, "3 workers")

    def needing(gb, job):
        return {**job, "device": "auto", "resources": {"gpu_memory_gb": gb}}

    big = service.submit(needing(20, tiny_job()))
    # Long enough (a few seconds) to be still running, side by side, when b's state is read.
    a = service.submit(needing(6, slow_job(epochs=30)))
    c = service.submit(needing(3, slow_job(epochs=30)))
    b = service.submit(needing(6, tiny_job()))
    service.wait_state(a["id"], "running")
    service.wait_state(c["id"], "running")
    with service.client() as cl:
        assert cl.get(f"/jobs/{b['id']}").json()["state"] == "queued"  # 6 + 3 + 6 > 10, one worker idle
        assert cl.get(f"/jobs/{b['id']}").json()["waiting_for"] is None  # it fits once memory frees up
        why = cl.get(f"/jobs/{big['id']}").json()["waiting_for"]
        assert why.startswith("needs 20.0 GB of GPU memory; the most a live worker offers is 10.0 GB")
        listed = {j["id"]: j for j in cl.get("/jobs").json()["data"]}
        assert listed[big["id"]]["waiting_for"] == why
    da, dc, db = (service.wait_state(j["id"], timeout=180) for j in (a, c, b))
    assert da["state"] == dc["state"] == db["state"] == "succeeded"
    assert da["started_at"] < dc["finished_at"] and dc["started_at"] < da["finished_at"]  # side by side
    assert db["started_at"] >= min(da["finished_at"], dc["finished_at"])  # only once memory was freed
    cli = subprocess.run([sys.executable, "-m", "trainyard", "status", str(big["id"]), "--url", service.url],
                         capture_output=True, text=True, timeout=30)
    assert cli.returncode == 0 and "the most a live worker offers is 10.0 GB" in " ".join(cli.stdout.split())
    with service.client() as cl:
        cl.post(f"/jobs/{big['id']}/cancel")


@on_sqlite_only  # the database plays no part in it
def test_a_worker_that_cannot_use_its_device_registers_unavailable_and_its_jobs_wait_saying_why(service):
    """`trainyard worker --device cuda:0` on a host where CUDA does not work (this machine: a CUDA 13 torch,
    no NVIDIA driver): the worker registers as unavailable with the cause and the fix, claims nothing, and a
    queued `cuda` job stays queued saying why. Nothing fails."""
    service.start_worker("cuda:0")
    with service.client() as c:
        [worker] = c.get("/workers").json()
        why = worker["unavailable"]
        assert worker["state"] == "unavailable" and worker["device"] == "cuda:0"
        assert "no NVIDIA driver" in why and "--device cpu" in why, why  # the cause, and the fixes
        job = service.submit({**tiny_job(), "device": "cuda"})
        time.sleep(2)  # an idle worker polls every 20 ms: it would have claimed (and failed) it by now
        got = c.get(f"/jobs/{job['id']}").json()
        assert got["state"] == "queued" and got["attempt"] == 0 and not got["errors"]
        assert got["waiting_for"] == (f"no live worker can use a device for cuda: worker {worker['id']} on "
                                      f"{worker['host']} is unavailable: {why}")
        devices = c.get("/devices").json()
        [listed] = devices["other_workers"]
        assert listed["id"] == worker["id"] and listed["unavailable"] == why and listed["state"] == "unavailable"
        assert c.get("/jobs", params={"state": "failed"}).json()["count"] == 0
    # Its warm-up child, forked as job processes are, saw CUDA's devices in PCI bus order (as NVML numbers them).
    engine = make_engine(service.env["TRAINYARD_DATABASE_URL"] or Settings(data_dir=service.data_dir).db_url)
    [row], _ = registry.list_workers(engine)
    engine.dispose()
    assert row["stats"]["build"]["cuda_device_order"] == "PCI_BUS_ID"


def test_a_device_that_fails_under_a_job_retries_it_on_another_worker(tmp_path):
    """A worker whose device fails under a running job (here: cuda:63, which no host has) fails the run
    `infrastructure`, takes no more jobs (unavailable, saying why), and the job runs on another worker."""
    settings = Settings(data_dir=tmp_path / "data", lease_s=5, heartbeat_s=0.5)
    settings.ensure_dirs()
    broken = Worker(settings, "cuda:63")
    migrate.prepare(broken.engine)
    broken.ctx = mp_context()
    registry.register_worker(broken.engine, broken.id, settings.node, os.getpid(), broken.device, {})
    job, _ = submit.enqueue(broken.engine, parse_spec({**tiny_job(), "device": "auto"}))
    broken.run_job(queue.claim(broken.engine, broken.id, broken.device, settings.lease_s))
    again = job_reads.get_job(broken.engine, job.id)
    assert again.state == "queued" and [(e["class"], e["type"]) for e in again.errors] == [
        ("infrastructure", "DeviceFailure")]
    assert "cuda:63" in broken.unavailable and "restart the worker" in broken.unavailable
    [row], _ = registry.list_workers(broken.engine)
    assert row["state"] == "unavailable" and row["stats"]["unavailable"] == broken.unavailable
    cpu = Worker(settings, "cpu", burst=True)
    assert cpu.run() == 0 and cpu.jobs_done == 1
    done = job_reads.get_job(broken.engine, job.id)
    assert done.state == "succeeded" and done.worker_id == cpu.id and done.attempt == 2
    broken.engine.dispose()


def test_a_worker_shows_the_job_it_began_at_once_not_a_heartbeat_later(tmp_path):
    """/workers names the job a worker runs as soon as it runs it: the heartbeat that says so is not held back
    to the next beat (30 s here, the first just past as the worker registered)."""
    from tests.helpers.service import serving
    with serving(tmp_path / "data", env={"TRAINYARD_HEARTBEAT_S": "30", "TRAINYARD_LEASE_S": "90"}) as svc:
        job = svc.submit(slow_job(epochs=100))
        svc.wait_state(job["id"], states=("running",), timeout=60, poll=0.05)
        began = time.monotonic()
        svc.wait_until(lambda: [w["job_id"] for w in svc.client().get("/workers").json()] == [job["id"]], 10,
                       "/workers naming the job")
        assert time.monotonic() - began < 5, "shown only at the next heartbeat"
        svc.client().post(f"/jobs/{job['id']}/cancel")
