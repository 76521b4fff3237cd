"""Input that once reached SQL unchecked, and what /workers shows whom (issue 37), on a live server on each database.

On PostgreSQL each of these was a 500: an id past the INTEGER columns (`sweep:2147483648:best`, the curves'
`since`), and a NUL character, which PostgreSQL's text cannot hold, in a filter, a name, a label or a worker's
id. Each is now a 4xx naming where. And /workers showed every member each worker's address and process id."""
import httpx
import pytest

from tests.helpers.backends import BACKENDS, fresh_database
from tests.helpers.service import Service
from tests.helpers.teams import make_team, service_engine
from trainyard.app.fleet import workers as workers_registry

JOB = {"kind": "train", "model": {"arch": "mlp"}, "data": {"dataset": "digits"}, "device": "cpu",
       "train": {"epochs": 1}}
SWEEP = {"job": JOB, "method": "grid", "parameters": {"train.lr": {"type": "choice", "values": [0.01]}}}
PAST = 2**31  # one past the INTEGER columns' largest value
WORKER = {"id": "w-inputs", "host": "gpu-7", "pid": 4242, "addr": "10.9.8.7"}


@pytest.fixture(scope="module", params=BACKENDS)
def live(request, tmp_path_factory):
    """A server without workers, its team (ann in alpha, ben in beta, ada an admin), and one worker's row as a
    worker on another host registers it."""
    with fresh_database(request.param, "inputs") as url:
        svc = Service(tmp_path_factory.mktemp("inputs") / "data", url).start_server()
        try:
            team = make_team(svc)
            engine = service_engine(svc)
            workers_registry.register_worker(engine, WORKER["id"], WORKER["host"], WORKER["pid"], "cpu",
                                             {"addr": WORKER["addr"]})
            engine.dispose()
            yield svc, team
        finally:
            svc.stop()


def nul_refused(r: httpx.Response, loc: list) -> None:
    assert r.status_code == 422, (r.request.method, r.request.url, r.status_code, r.text)
    assert r.json()["detail"][0]["loc"] == loc and r.json()["detail"][0]["type"] == "nul_character", r.text


def test_a_sweep_reference_past_the_id_column_is_a_422(live):
    svc, team = live
    with team.client("ann") as c:
        for body, field in (({"kind": "predict", "model_job": f"sweep:{PAST}:best", "inputs": [[0.0]]}, "model_job"),
                            ({**JOB, "init_from": f"sweep:{PAST}:best"}, "init_from")):
            r = c.post("/jobs", json=body)
            assert r.status_code == 422 and r.json()["detail"][0]["loc"][:2] == ["body", field], r.text
            assert f"at most {PAST - 1}" in r.text
        r = c.post("/sweeps", json={**SWEEP, "job": {**JOB, "init_from": f"sweep:{PAST}:best"}})
        assert r.status_code == 422 and f"at most {PAST - 1}" in r.text, r.text
        r = c.post("/sweeps", json={**SWEEP, "parameters": {
            "init_from": {"type": "choice", "values": [f"sweep:{PAST}:best"]}}})
        assert r.status_code == 422, r.text
        # The largest id the column holds is looked up: a sweep that does not exist, as before.
        r = c.post("/jobs", json={**JOB, "init_from": f"sweep:{PAST - 1}:best"})
        assert r.status_code == 422 and "does not exist" in r.text, r.text


def test_a_curves_cursor_past_the_id_column_is_a_422(live):
    svc, team = live
    with team.client("ann") as c:
        sweep = c.post("/sweeps", json=SWEEP).raise_for_status().json()
        # The query reaches the metrics only once the sweep has a trial (its driver makes one within a second).
        svc.wait_until(lambda: c.get(f"/sweeps/{sweep['id']}").json()["trial_count"] >= 1, 30, "a trial")
        r = c.get(f"/sweeps/{sweep['id']}/curves", params={"since": PAST})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "since"], r.text
        r = c.get(f"/sweeps/{sweep['id']}/curves", params={"since": PAST - 1})
        assert r.status_code == 200 and r.json()["next"] == PAST - 1, r.text


def test_a_nul_in_a_query_is_a_422(live):
    svc, team = live
    with team.client("ada") as c:
        for name in ("action", "actor"):
            nul_refused(c.get("/admin/audit", params={name: "token\x00issue"}), ["query", name])
            nul_refused(c.get(f"/admin/audit?{name}=token%00issue"), ["query", name])
        nul_refused(c.post("/workers/w-inputs/drain?why=%00"), ["query", "why"])
        assert c.get("/admin/audit", params={"action": "token_issue"}).status_code == 200


@pytest.mark.parametrize("method, path", [
    ("PATCH", "/admin/projects/al%00pha"), ("PUT", "/admin/projects/alpha/members/a%00nn"),
    ("DELETE", "/admin/projects/al%00pha/members/ann"), ("POST", "/admin/users/a%00nn/tokens"),
    ("POST", "/workers/w%00inputs/drain"), ("POST", "/workers/w%00inputs/undrain")])
def test_a_nul_in_a_path_is_a_422(live, method, path):
    svc, team = live
    with team.client("ada") as c:
        body = {"share": 2} if method == "PATCH" else {} if path.endswith("/tokens") else None
        nul_refused(c.request(method, path, json=body), ["path"])


def test_a_nul_in_a_json_body_is_a_422(live):
    svc, team = live
    with team.client("ada") as c:
        nul_refused(c.post("/admin/users", json={"name": "e\x00ve"}), ["body", "name"])
        nul_refused(c.post("/admin/projects", json={"name": "gam\x00ma"}), ["body", "name"])
        nul_refused(c.post("/admin/users/ann/tokens", json={"project": "al\x00pha"}), ["body", "project"])
        nul_refused(c.post("/admin/users/ann/tokens", json={"project": "alpha", "label": "lap\x00top"}),
                    ["body", "label"])
        nul_refused(c.patch("/admin/projects/alpha", json={"limits": {"dev\x00ices": 1}}),
                    ["body", "limits", "devices"])
        nul_refused(c.post("/workers/w-inputs/drain", json={"note": ["ok", "\x00"]}), ["body", "note", 1])
        # A backslash before "u0000" is text, not a NUL: the label is kept as written.
        r = c.post("/admin/users/ann/tokens", content=rb'{"project": "alpha", "label": "a\\u0000b"}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 201 and r.json()["label"] == "a\\u0000b", r.text
    with team.client("ann") as c:
        nul_refused(c.post("/jobs", json={**JOB, "train": {"epochs": 1, "lr": 0.01}, "name": "\x00"}),
                    ["body", "name"])


def test_members_see_the_workers_but_not_where_their_processes_live(live):
    svc, team = live
    with team.client("ann") as c:
        (w,) = [w for w in c.get("/workers").raise_for_status().json() if w["id"] == WORKER["id"]]
        assert w["host"] == WORKER["host"] and w["addr"] is None and w["pid"] is None, w
        views = [v for v in c.get("/devices").raise_for_status().json()["cpu"]["workers"] if v["id"] == WORKER["id"]]
        assert views and all(v["pid"] is None for v in views), views
    with team.client("ada") as c:
        (w,) = [w for w in c.get("/workers").raise_for_status().json() if w["id"] == WORKER["id"]]
        assert (w["addr"], w["pid"]) == (WORKER["addr"], WORKER["pid"]), w
        views = [v for v in c.get("/devices").raise_for_status().json()["cpu"]["workers"] if v["id"] == WORKER["id"]]
        assert views and all(v["pid"] == WORKER["pid"] for v in views), views
