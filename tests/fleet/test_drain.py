"""Eight workers in separate processes drain 500 tiny jobs, each exactly once, on SQLite and on
PostgreSQL (a fresh schema per run): the claim, the wake-ups and the fencing under real contention."""
import pytest

from tests.helpers.jobs import tiny_job
from tests.helpers.service import Service

pytestmark = pytest.mark.slow
WORKERS, JOBS = 8, 500


def test_eight_workers_drain_500_jobs_each_exactly_once(tmp_path, backend_url):
    svc = Service(tmp_path / "data", backend_url).start_server()
    try:
        for _ in range(WORKERS):  # side by side: each fork server imports torch
            svc.start_worker("cpu", wait=False)
        with svc.client() as c:
            svc.wait_until(lambda: sum(w["state"] == "idle" for w in c.get("/workers").json()) == WORKERS, 240,
                           f"{WORKERS} idle workers")
            body = tiny_job(epochs=1, checkpoint_every=0)
            ids = [c.post("/jobs", json=body).raise_for_status().json()["id"] for _ in range(JOBS)]
            svc.wait_until(lambda: c.get("/jobs", params={"state": "succeeded", "limit": 1}).json()["count"] == JOBS,
                           600, f"{JOBS} jobs to succeed")
            jobs = c.get("/jobs", params={"limit": 500}).json()["data"]
        assert sorted(j["id"] for j in jobs) == sorted(ids)
        assert all(j["state"] == "succeeded" and j["runs"] == 1 and j["attempt"] == 1 for j in jobs)
        assert len({j["worker_id"] for j in jobs}) == WORKERS  # every worker took part
        for i in ids:  # each job's process started once
            assert (svc.data_dir / "logs" / f"{i}.log").read_text().count("job process pid") == 1
    finally:
        svc.stop()
