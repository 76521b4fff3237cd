"""Jobs belong to projects, over HTTP with the real server and a CPU worker, on SQLite and on PostgreSQL: ben
(project beta) meets ann's job (alpha), trained to success, as a job that does not exist on every job route
(reads, actions, the event stream, every artifact format: the same 404 and body as a missing id) and in none of
his lists or counts; ann and ada (an admin) see it; an Idempotency-Key is the project's own; naming another
project's job in a submit is 422 "does not exist"; the audit record holds every action of the test, with actor,
project and client; a revoked token is refused on the next request; TRAINYARD_API_TOKEN still acts as the admin,
and a server with no token configured answers token-less requests as before."""
import time

import httpx
import pytest

from tests.helpers.backends import BACKENDS
from tests.helpers.jobs import tiny_job
from tests.helpers.service import TERMINAL, Service, live_service
from tests.helpers.teams import service_engine
from trainyard.app import accounts
from trainyard.app.accounts import audit

pytestmark = pytest.mark.slow  # starts the real server and a worker

ADMIN_TOKEN = "ops-secret-projects"
MISSING = 999_999
WAITING = {**tiny_job(), "device": "cuda"}  # no worker serves CUDA here: it stays queued until cancelled
FORMATS = ("safetensors", "pt", "meta", "onnx", "pt2", "torchscript")
GRID = {"job": tiny_job(epochs=1), "method": "grid", "max_concurrent": 1, "metric": "val_loss",
        "parameters": {"train.lr": {"type": "choice", "values": [0.01]}}}


def routes(job_id: int) -> list[tuple[str, str]]:
    """Every job route: reads, actions, the event stream, every artifact format."""
    return [("GET", f"/jobs/{job_id}"), ("POST", f"/jobs/{job_id}/cancel"), ("POST", f"/jobs/{job_id}/retry"),
            ("DELETE", f"/jobs/{job_id}"), ("POST", f"/jobs/{job_id}/pin"), ("POST", f"/jobs/{job_id}/unpin"),
            ("GET", f"/jobs/{job_id}/metrics"), ("GET", f"/jobs/{job_id}/metrics?since=1"),
            ("GET", f"/jobs/{job_id}/result"), ("GET", f"/jobs/{job_id}/logs"), ("GET", f"/jobs/{job_id}/logs?tail=50"),
            ("GET", f"/jobs/{job_id}/events"),
            *(("GET", f"/jobs/{job_id}/artifact?format={f}") for f in FORMATS)]


def as_missing(c: httpx.Client, method: str, path: str, job_id: int, missing: int = MISSING,
               kind: str = "job") -> None:
    """The answer at path is the one a missing id gets: 404, the same body but for the id."""
    theirs = c.request(method, path)
    nothing = c.request(method, path.replace(f"/{job_id}", f"/{missing}", 1))
    assert nothing.status_code == 404 and nothing.json() == {"detail": f"{kind} {missing} not found"}, nothing.text
    assert theirs.status_code == 404, (method, path, theirs.status_code, theirs.text)
    assert theirs.json() == {"detail": f"{kind} {job_id} not found"}, (method, path, theirs.text)
    assert theirs.headers["content-type"] == nothing.headers["content-type"]


def wait(c: httpx.Client, job_id: int, states=TERMINAL, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = c.get(f"/jobs/{job_id}").json()
        if job["state"] in states:
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']}"
        time.sleep(0.2)


def naming(base: dict, field: str, named: int, *after: str) -> dict:
    """The job `base` naming job `named` in field (model_job, init_from, after), waiting for `after` too."""
    if field == "after":
        return {**base, "after": [*after, named]}
    return {**base, field: named, "after": list(after)}


def every_listed(c: httpx.Client, **params) -> tuple[set[int], int]:
    """The ids of every page of GET /jobs with these filters, and its count."""
    found, offset = set(), 0
    while True:
        page = c.get("/jobs", params={**params, "limit": 500, "offset": offset}).json()
        found |= {j["id"] for j in page["data"]}
        if page["next_offset"] is None:
            return found, page["count"]
        offset = page["next_offset"]


# A server with TRAINYARD_API_TOKEN set and a CPU worker, with the team (ann, ben, ada) on its database.
live = live_service(env={"TRAINYARD_API_TOKEN": ADMIN_TOKEN}, backends=BACKENDS, team=True)


def test_another_projects_job_is_a_job_that_does_not_exist(live):
    svc, team = live
    engine = service_engine(svc)
    alpha, beta = (accounts.get_project(engine, p)["id"] for p in ("alpha", "beta"))
    with team.client("ann") as ann, team.client("ben") as ben, team.client("ada") as ada, svc.client() as ops:
        made = ann.post("/jobs", json=tiny_job(), headers={"Idempotency-Key": "same-key"})
        assert made.status_code == 201 and (made.json()["owner"], made.json()["project_id"]) == ("ann", alpha)
        job = made.json()["id"]
        held = ann.post("/jobs", json=WAITING).json()["id"]  # stays queued: ann's to cancel, retry and delete
        sweep = ann.post("/sweeps", json=GRID)
        assert sweep.status_code == 201, sweep.text
        sweep_id = sweep.json()["id"]
        assert wait(ann, job)["state"] == "succeeded"

        # ben: the same key makes his own job; ann's retry of hers answers hers (and records nothing)
        mine = ben.post("/jobs", json=tiny_job(), headers={"Idempotency-Key": "same-key"})
        assert mine.status_code == 201 and mine.json()["id"] not in (job, held), mine.text
        assert (mine.json()["owner"], mine.json()["project_id"]) == ("ben", beta)
        again = ann.post("/jobs", json=tiny_job(), headers={"Idempotency-Key": "same-key"})
        assert again.status_code == 200 and again.json()["id"] == job
        assert ben.post("/jobs", json=tiny_job(), headers={"Idempotency-Key": "same-key"}).json()["id"] == \
            mine.json()["id"]
        bens = [mine.json()["id"]]

        # ben naming ann's jobs: 422 "does not exist", as for a missing id; "$N" stays his batch's
        predict = {"kind": "predict", "inputs": [[5.1, 3.5, 1.4, 0.2]], "device": "cpu"}
        for base, field, ref in ((predict, "model_job", job), (tiny_job(), "init_from", job),
                                 (tiny_job(), "after", held)):
            for named in (ref, MISSING):  # ann's, then an id never given: the same answer
                r = ben.post("/jobs", json=naming(base, field, named))
                said = f"after: job {named}" if field == "after" else f"{field} {named}"
                assert r.status_code == 422 and f"{said} does not exist" in r.text, (field, r.text)
            r = ben.post("/jobs/batch", json=[tiny_job(), naming(base, field, ref, "$0")])
            assert r.status_code == 422 and "does not exist" in r.text and str(ref) in r.text, r.text
        batch = ben.post("/jobs/batch", json=[tiny_job(), {"kind": "predict", "model_job": "$0",
                                                           "inputs": [[5.1, 3.5, 1.4, 0.2]], "device": "cpu"}])
        assert batch.status_code == 201, batch.text
        bens += [j["id"] for j in batch.json()]
        assert all((j["owner"], j["project_id"]) == ("ben", beta) for j in batch.json())

        # every job route: ann's job and her queued one are, to ben, jobs that do not exist
        for job_id in (job, held):
            for method, path in routes(job_id):
                as_missing(ben, method, path, job_id)
        as_missing(ben, "GET", f"/sweeps/{sweep_id}/events", sweep_id, kind="sweep")
        assert ann.get(f"/jobs/{held}").json()["state"] == "queued"  # ben's actions did nothing
        assert ann.get(f"/jobs/{job}").json()["pinned"] is False

        # ...and none of ann's jobs is in any of ben's lists or counts
        theirs = {job, held}
        for params in ({}, {"state": "succeeded"}, {"state": "queued"}, {"kind": "train"}, {"sweep": sweep_id}):
            seen, count = every_listed(ben, **params)
            assert not seen & theirs and seen <= set(bens) and count == len(seen), (params, seen, count)
        assert every_listed(ben) == (set(bens), len(bens))
        assert every_listed(ben, sweep=sweep_id) == (set(), 0)

        # ann and the admins see it, on every read route
        for who in (ann, ada, ops):
            assert who.get(f"/jobs/{job}").json()["owner"] == "ann"
            assert theirs <= every_listed(who)[0]
            for path in ("metrics", "result", "logs", "artifact", "artifact?format=meta"):
                assert who.get(f"/jobs/{job}/{path}").status_code == 200, path
            with who.stream("GET", f"/jobs/{job}/events") as r:
                assert r.status_code == 200 and "event: end" in r.read().decode()
        assert set(bens) <= every_listed(ada)[0] and set(bens) <= every_listed(ops)[0]
        assert ann.get(f"/jobs/{bens[0]}").status_code == 404
        with ann.stream("GET", f"/sweeps/{sweep_id}/events") as r:
            assert r.status_code == 200

        # ann's actions, and the admins'
        assert ann.post(f"/jobs/{job}/pin").json()["pinned"] is True
        assert ann.post(f"/jobs/{job}/unpin").json()["pinned"] is False
        assert ada.post(f"/jobs/{job}/pin").json()["pinned"] is True
        assert ops.post(f"/jobs/{job}/unpin").json()["pinned"] is False
        assert ann.post(f"/jobs/{held}/cancel").json()["state"] == "cancelled"
        assert ann.post(f"/jobs/{held}/retry").json()["state"] == "queued"
        assert ada.post(f"/jobs/{held}/cancel").json()["state"] == "cancelled"
        assert ann.delete(f"/jobs/{held}").status_code == 204
        assert ann.get(f"/jobs/{held}").status_code == 404

    records = audit.entries(engine, limit=1000)
    engine.dispose()
    did = {(e["actor"], e["project"], e["action"], e["target"]) for e in records}
    expected = {("ann", "alpha", "submit", f"job {job}"), ("ann", "alpha", "submit", f"job {held}"),
                *(("ben", "beta", "submit", f"job {b}") for b in bens),
                ("ann", "alpha", "pin", f"job {job}"), ("ann", "alpha", "unpin", f"job {job}"),
                ("ada", None, "pin", f"job {job}"), ("admin", None, "unpin", f"job {job}"),
                ("ann", "alpha", "cancel", f"job {held}"), ("ann", "alpha", "retry", f"job {held}"),
                ("ada", None, "cancel", f"job {held}"), ("ann", "alpha", "delete", f"job {held}")}
    assert expected <= did, expected - did
    ours = [e for e in records if e["target"] and e["target"].startswith("job ")]
    assert sum(e["target"] == f"job {job}" and e["action"] == "submit" for e in ours) == 1  # the replay: none
    assert not [e for e in ours if e["actor"] == "ben" and e["target"] in (f"job {job}", f"job {held}")]
    assert all(e["client"] == "127.0.0.1" and e["at"] > 0 for e in ours)
    batch_records = [e for e in ours if e["target"] in (f"job {bens[1]}", f"job {bens[2]}")]
    assert [e["detail"]["batch"] for e in batch_records] == [bens[1:], bens[1:]]


def test_a_revoked_token_is_refused_on_the_next_request(live):
    svc, team = live
    engine = service_engine(svc)
    try:
        made = accounts.issue_token(engine, "ben", "beta", label="laptop")
        with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {made['token']}"}, timeout=30) as c:
            assert c.get("/jobs").status_code == 200
            accounts.revoke_token(engine, made["id"])
            refused = c.get("/jobs")
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            assert c.post("/jobs", json=tiny_job()).status_code == 401
    finally:
        engine.dispose()
    with team.client("ben") as ben:  # his other token still works
        assert ben.get("/jobs").status_code == 200
    with httpx.Client(base_url=svc.url, timeout=30) as anonymous:  # a token is configured: none sent is refused
        assert anonymous.get("/jobs").status_code == 401
        assert anonymous.get("/jobs", headers={"Authorization": "Bearer tyk_not-a-token"}).status_code == 401


def test_a_server_without_a_token_answers_tokenless_requests_as_before(tmp_path):
    svc = Service(tmp_path / "data").start_server()
    try:
        with svc.client() as c:
            made = c.post("/jobs", json=WAITING, headers={"Idempotency-Key": "k"})
            assert made.status_code == 201 and (made.json()["owner"], made.json()["project_id"]) == ("admin", None)
            job = made.json()["id"]
            assert c.post("/jobs", json=WAITING, headers={"Idempotency-Key": "k"}).json()["id"] == job
            assert c.get(f"/jobs/{job}").status_code == 200 and every_listed(c) == ({job}, 1)
            assert c.post(f"/jobs/{job}/cancel").json()["state"] == "cancelled"
        engine = service_engine(svc)
        try:
            did = [(e["actor"], e["action"], e["target"]) for e in audit.entries(engine) if e["target"] == f"job {job}"]
        finally:
            engine.dispose()
        assert did == [("admin", "cancel", f"job {job}"), ("admin", "submit", f"job {job}")]
    finally:
        svc.stop()
