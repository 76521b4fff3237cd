"""Issue 37's quota and priority findings, as a member would try them against a live server on both databases:
submits, batches and retries made all at once never take a project past queued_jobs (the count is read in the
inserting transaction, the project's row held: app/accounts/quotas.py), and a member asks for no more priority than the
project's max_priority (0 unset) allows, by any route that queues a job; admins are not limited. No worker runs,
so what is submitted stays queued."""
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.backends import BACKENDS, fresh_database
from tests.helpers.jobs import tiny_job
from tests.helpers.service import Service
from tests.helpers.teams import Team, make_team

JOB = tiny_job(epochs=1)
SWEEP = {"job": JOB, "method": "grid", "max_concurrent": 1, "metric": "val_loss",
         "parameters": {"train.lr": {"type": "choice", "values": [0.01]}}}


@pytest.fixture(scope="module", params=BACKENDS)
def live(request, tmp_path_factory):
    """A server without workers and the team (ann in alpha, ben in beta, ada an admin); alpha's limits are each
    test's to set."""
    with fresh_database(request.param, "quota") as url:
        svc = Service(tmp_path_factory.mktemp("quota") / "data", url, env={"TRAINYARD_API_TOKEN": "ops-quota"})
        try:
            svc.start_server()
            yield make_team(svc)
        finally:
            svc.stop()


def limit(team: Team, **limits) -> None:
    """alpha's limits set (None: removed), and nothing of its left queued."""
    with team.client("ada") as ada:
        r = ada.patch("/admin/projects/alpha", json={"limits": limits})
        assert r.status_code == 200, r.text
        for job in ada.get("/jobs", params={"state": "queued", "limit": 500}).json()["data"]:
            assert ada.post(f"/jobs/{job['id']}/cancel").status_code == 200


def queued(team: Team) -> int:
    with team.client("ann") as ann:
        return ann.get("/jobs", params={"state": "queued"}).json()["count"]


def at_once(team: Team, user: str, requests: list[tuple[str, object]]) -> list[int]:
    """Each (path, body) POSTed by its own client, all released together; their status codes."""
    gate = threading.Barrier(len(requests))

    def post(request: tuple[str, object]) -> int:
        path, body = request
        with team.client(user) as c:
            c.get("/me")  # connected before the gate
            gate.wait()
            return c.post(path, json=body).status_code
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(post, requests))


def test_parallel_submits_and_batches_never_pass_queued_jobs(live):
    limit(live, queued_jobs=3)
    codes = at_once(live, "ann", [("/jobs", JOB)] * 20)
    assert sorted(codes) == [201] * 3 + [409] * 17 and queued(live) == 3
    limit(live, queued_jobs=3)
    codes = at_once(live, "ann", [("/jobs/batch", [JOB] * 3)] * 20)
    assert sorted(codes) == [201] + [409] * 19 and queued(live) == 3


def test_retrying_cancelled_jobs_is_a_submit(live):
    limit(live, queued_jobs=3)
    with live.client("ann") as ann:
        first = [ann.post("/jobs", json=JOB).json()["id"] for _ in range(3)]
        assert ann.post("/jobs", json=JOB).status_code == 409
        for job_id in first:
            assert ann.post(f"/jobs/{job_id}/cancel").status_code == 200
        second = [ann.post("/jobs", json=JOB).json()["id"] for _ in range(3)]
        for job_id in first:  # before: each came back, 6 queued, and again after each cancel
            r = ann.post(f"/jobs/{job_id}/retry")
            assert r.status_code == 409 and "(queued_jobs)" in r.json()["detail"], r.text
        assert queued(live) == 3
        for job_id in second:
            assert ann.post(f"/jobs/{job_id}/cancel").status_code == 200
    codes = at_once(live, "ann", [(f"/jobs/{job_id}/retry", None) for job_id in first + second])
    assert sorted(codes) == [200] * 3 + [409] * 3 and queued(live) == 3


def test_a_member_asks_for_no_more_priority_than_the_project_allows(live):
    limit(live, queued_jobs=None, max_priority=None)
    with live.client("ann") as ann, live.client("ada") as ada:
        r = ann.post("/jobs", json={**JOB, "priority": 1000})  # before: 201, and it preempted a teammate's job
        assert r.status_code == 422, r.text
        [error] = r.json()["detail"]
        assert error["loc"] == ["body", "priority"] and "max_priority" in error["msg"], error
        assert ann.post("/jobs", json={**JOB, "priority": 0}).status_code == 201  # the default allows 0
        assert ada.post("/jobs", json={**JOB, "priority": 1000}).status_code == 201  # an admin is not limited
        # An admin acting in alpha makes a job of priority 1000 there: ann may not bring it back herself.
        token = ada.post("/admin/users/ada/tokens", json={"project": "alpha"}).json()["token"]
        with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {token}"}) as ada_alpha:
            high = ada_alpha.post("/jobs", json={**JOB, "priority": 1000}).json()["id"]
            assert ada_alpha.post(f"/jobs/{high}/cancel").status_code == 200
        r = ann.post(f"/jobs/{high}/retry")
        assert r.status_code == 422 and "priority 1000" in r.text and "max_priority" in r.text, r.text

        limit(live, max_priority=5)
        for path, body, loc in (
                ("/jobs", {**JOB, "priority": 6}, ["body", "priority"]),
                ("/jobs/batch", [JOB, {**JOB, "priority": 6}], ["body", 1, "priority"]),
                ("/sweeps", {**SWEEP, "job": {**JOB, "priority": 6}}, ["body", "job", "priority"]),
                ("/sweeps", {**SWEEP, "parameters": {"priority": {"type": "choice", "values": [0, 9]}}},
                 ["body", "parameters", "priority"]),
                ("/sweeps", {**SWEEP, "parameters": {"priority": {"type": "int", "low": 0, "high": 1000}}},
                 ["body", "parameters", "priority"])):
            r = ann.post(path, json=body)
            assert r.status_code == 422, (path, r.text)
            [error] = r.json()["detail"]
            assert error["loc"] == loc and "its limit of 5 (max_priority)" in error["msg"], (path, error)
        assert ann.post("/jobs", json={**JOB, "priority": 5}).status_code == 201

        # (d) With the cap raised, the same requests go through.
        assert ada.patch("/admin/projects/alpha", json={"limits": {"max_priority": 1001}}).status_code == 422
        limit(live, max_priority=1000)
        assert ann.post("/jobs", json={**JOB, "priority": 1000}).status_code == 201
        assert ann.post("/jobs/batch", json=[JOB, {**JOB, "priority": 1000}]).status_code == 201
        assert ann.post(f"/jobs/{high}/retry").status_code == 200
        sweep = ann.post("/sweeps", json={**SWEEP, "job": {**JOB, "priority": 1000}})
        assert sweep.status_code == 201, sweep.text
        assert ann.post(f"/sweeps/{sweep.json()['id']}/cancel").status_code == 200
