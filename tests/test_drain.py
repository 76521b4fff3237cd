"""Draining a worker over HTTP, with a real worker process: it finishes what it runs, claims nothing
more, shows as draining, and takes jobs again once undrained."""
import json
import subprocess
import sys
import time

import pytest

from tests.conftest import slow_job, tiny_job

pytestmark = pytest.mark.slow


def test_drain_lets_the_running_job_finish_then_claims_nothing_until_undrain(service):
    service.start_worker("cpu")
    with service.client() as c:
        [worker] = c.get("/workers").json()
        running = service.submit(slow_job(epochs=6))
        service.wait_state(running["id"], "running")
        r = c.post(f"/workers/{worker['id']}/drain")
        assert r.status_code == 200 and r.json()["draining"] is True and r.json()["id"] == worker["id"]
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
