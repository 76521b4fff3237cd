"""The admin surface over HTTP and through the CLI, against the real server (and a CPU worker): an admin makes a
project, a user, a membership and a token, which works at once and is refused the moment it is revoked; project
limits are checked key by key; anyone but an admin gets 403 on every /admin route, on draining a worker and on
collecting the store; the audit record holds each change with its actor and client address; a user's /metrics,
/workers and /devices show nothing of another project's jobs, an admin's show everything."""
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import insert

from tests.helpers.backends import BACKENDS, fresh_database
from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.service import Service, live_service
from tests.helpers.teams import Team, make_team
from trainyard.app import accounts
from trainyard.app.accounts import Principal
from trainyard.app.db import sweeps, write
from trainyard.app.jobs import submit
from trainyard.app.observe import prometheus
from trainyard.app.spec import parse_spec

ROOT = "root-admin-secret"  # TRAINYARD_API_TOKEN: the operators' admin token
TRAINYARD = Path(sys.executable).with_name("trainyard")
ADMIN_ROUTES = [("GET", "/admin/users", None), ("POST", "/admin/users", {"name": "eve"}),
                ("GET", "/admin/projects", None), ("POST", "/admin/projects", {"name": "evil"}),
                ("PATCH", "/admin/projects/alpha", {"share": 9}),
                ("PUT", "/admin/projects/alpha/members/ben", None),
                ("DELETE", "/admin/projects/alpha/members/ann", None),
                ("POST", "/admin/users/ben/tokens", {"project": "alpha"}), ("DELETE", "/admin/tokens/1", None),
                ("GET", "/admin/audit", None), ("POST", "/workers/any/drain", None),
                ("PATCH", "/admin/users/ann", {"admin": True}), ("DELETE", "/admin/users/ben", None),
                ("POST", "/workers/any/undrain", None), ("POST", "/storage/collect", None)]


@pytest.fixture(params=BACKENDS)
def accounts_service(request, tmp_path):
    """A server with TRAINYARD_API_TOKEN, on SQLite or PostgreSQL, and its team (ann, ben, ada)."""
    with fresh_database(request.param, "adm") as url:
        svc = Service(tmp_path / "data", url, env={"TRAINYARD_API_TOKEN": ROOT}).start_server()
        try:
            yield svc, make_team(svc)
        finally:
            svc.stop()


live = live_service(env={"TRAINYARD_API_TOKEN": ROOT}, team=True)  # and its team


def ok(r: httpx.Response, status: int = 200):
    assert r.status_code == status, (r.request.method, r.request.url, r.status_code, r.text)
    return r.json() if r.content else None


@pytest.mark.slow
def test_an_admin_makes_a_project_user_and_token_that_works_until_revoked(accounts_service):
    svc, team = accounts_service
    with team.client("ada") as ada:
        made = ok(ada.post("/admin/projects", json={"name": "gamma", "share": 2,
                                                    "limits": {"devices": 2, "gpu_memory_gb": 40.5}}), 201)
        assert (made["share"], made["limits"], made["members"]) == (2.0, {"devices": 2, "gpu_memory_gb": 40.5}, [])
        assert ok(ada.post("/admin/users", json={"name": "cal"}), 201)["admin"] is False
        assert "exists" in ok(ada.post("/admin/users", json={"name": "cal"}), 409)["detail"]
        assert ok(ada.put("/admin/projects/gamma/members/cal"))["members"] == ["cal"]
        refused = ok(ada.post("/admin/users/cal/tokens", json={"project": "alpha"}), 409)  # not a member of alpha
        assert "not in project" in refused["detail"]
        issued = ok(ada.post("/admin/users/cal/tokens", json={"project": "gamma", "label": "laptop"}), 201)
        token = issued["token"]
        assert token.startswith("tyk_") and (issued["user"], issued["project"]) == ("cal", "gamma")
        cal = httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert ok(cal.get("/me")) == {"user": "cal", "admin": False, "project": "gamma"}  # at once
        users = {u["name"]: u for u in ok(ada.get("/admin/users"))}
        assert users["cal"]["projects"] == ["gamma"] and token not in json.dumps(users)
        assert [(t["id"], t["label"]) for t in users["cal"]["tokens"]] == [(issued["id"], "laptop")]

        changed = ok(ada.patch("/admin/projects/gamma", json={"limits": {"queued_jobs": 5, "devices": None}}))
        assert changed["limits"] == {"gpu_memory_gb": 40.5, "queued_jobs": 5} and changed["share"] == 2.0
        assert ok(ada.patch("/admin/projects/gamma", json={"share": 0.5}))["limits"] == changed["limits"]
        assert "not found" in ok(ada.patch("/admin/projects/nope", json={"share": 1}), 404)["detail"]

        ok(ada.delete(f"/admin/tokens/{issued['id']}"), 204)
        assert cal.get("/me").status_code == 401  # refused at once
        assert cal.get("/jobs").status_code == 401
        ok(ada.delete(f"/admin/tokens/{issued['id']}"), 404)
        cal.close()
        assert ok(ada.delete("/admin/projects/gamma/members/cal"))["members"] == []
        ok(ada.delete("/admin/projects/gamma/members/cal"), 404)
        ok(ada.put("/admin/projects/gamma/members/nobody"), 404)

        audit = ok(ada.get("/admin/audit"))
        mine = [(e["action"], e["target"]) for e in audit if e["actor"] == "ada"]
        assert mine == [("member_remove", "project gamma"), ("token_revoke", f"token {issued['id']}"),
                        ("project_set", "project gamma"), ("project_set", "project gamma"),
                        ("token_issue", f"token {issued['id']}"), ("member_add", "project gamma"),
                        ("user_add", "user cal"), ("project_add", "project gamma")]  # newest first; no refusals
        assert all(e["client"] == "127.0.0.1" and e["project"] is None for e in audit if e["actor"] == "ada")
        assert audit[-1]["detail"] == {"share": 2.0, "limits": {"devices": 2, "gpu_memory_gb": 40.5}}
        assert [e["target"] for e in ok(ada.get("/admin/audit", params={"action": "token_issue"}))] == [
            f"token {issued['id']}"]
        page = ok(ada.get("/admin/audit", params={"limit": 2, "before": audit[1]["id"], "actor": "ada"}))
        assert [e["id"] for e in page] == [audit[2]["id"], audit[3]["id"]]
    with svc.client() as root:  # TRAINYARD_API_TOKEN is the admin "admin"
        assert ok(root.get("/me")) == {"user": "admin", "admin": True, "project": None}
        ok(root.post("/admin/users", json={"name": "dee", "admin": True}), 201)
        assert ok(root.get("/admin/audit", params={"actor": "admin", "limit": 1}))[0]["action"] == "user_add"


def test_limits_accept_only_known_keys_of_sane_types(live):
    svc, team = live
    with team.client("ada") as ada:
        for limits, key in (({"gpus": 1}, "gpus"), ({"devices": -1}, "devices"), ({"devices": 1.5}, "devices"),
                            ({"devices": True}, "devices"), ({"queued_jobs": "10"}, "queued_jobs"),
                            ({"gpu_memory_gb": -0.5}, "gpu_memory_gb"), ({"stored_bytes": None, "x": 1}, "x"),
                            ({"running_sweeps": [1]}, "running_sweeps")):
            for method, path, body in (("POST", "/admin/projects", {"name": "lim", "limits": limits}),
                                       ("PATCH", "/admin/projects/alpha", {"limits": limits})):
                r = ada.request(method, path, json=body)
                assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "limits", key], r.text
        assert ada.post("/admin/projects", json={"name": "lim", "share": 0}).status_code == 422
        made = ok(ada.post("/admin/projects", json={"name": "lim", "limits": {
            "devices": 0, "gpu_memory_gb": 8, "queued_jobs": 100, "running_sweeps": 2, "stored_bytes": 2**40}}), 201)
        assert made["limits"]["gpu_memory_gb"] == 8.0 and made["limits"]["stored_bytes"] == 2**40
        assert ok(ada.get("/admin/projects"))[-1]["limits"] == made["limits"]


def test_non_admins_get_403_on_every_admin_route_and_on_fleet_changes(live):
    svc, team = live
    for user in ("ann", "ben"):
        with team.client(user) as c:
            for method, path, body in ADMIN_ROUTES:
                r = c.request(method, path, json=body)
                assert r.status_code == 403 and "not an admin" in r.json()["detail"], (user, method, path, r.text)
            assert ok(c.get("/me"))["admin"] is False
            assert "kinds" in ok(c.get("/storage"))  # reading the store's usage is anyone's
            assert ok(c.get("/workers"))[0]["device"] == "cpu"
    with team.client("ada") as ada:  # none of it changed anything
        assert {p["name"]: p["members"] for p in ok(ada.get("/admin/projects"))}["alpha"] == ["ann"]
        assert not [e for e in ok(ada.get("/admin/audit")) if e["actor"] in ("ann", "ben")]
    with httpx.Client(base_url=svc.url, timeout=30) as anonymous:
        assert anonymous.get("/admin/users").status_code == 401 and anonymous.get("/me").status_code == 401


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def scrape(team: Team, user: str) -> list[tuple[str, dict[str, str], float]]:
    with team.client(user) as c:
        return samples(ok_text(c.get("/metrics")))


def ok_text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.text


def test_a_users_gauges_count_their_projects_rows_only(engine):
    """Jobs, the queue, sweeps and trials, per project (each backend); rows of no project only for admins."""
    alpha, beta = (accounts.add_project(engine, name)["id"] for name in ("alpha", "beta"))
    spec = parse_spec(tiny_job())
    with write(engine) as conn:
        for project in (alpha, alpha, None):
            submit.insert_job(conn, spec, project_id=project)
        made = [conn.execute(insert(sweeps).values(name="s", state="running", spec={}, created_at=0.0, trial_count=1,
                                                   project_id=project).returning(sweeps.c.id)).scalar_one()
                for project in (alpha, alpha, beta)]
        submit.insert_job(conn, spec, sweep={"id": made[2], "trial": 0, "params": {}}, project_id=beta)

    def seen(who: Principal | None) -> dict[tuple[str, str], float]:
        text = prometheus.render(prometheus.registry(engine, 30, who=who)).decode()
        return {(n, labels.get("state", labels.get("device", ""))): v for n, labels, v in samples(text)
                if n in ("trainyard_jobs", "trainyard_queue_depth", "trainyard_sweeps", "trainyard_sweep_trials",
                         "trainyard_jobs_submitted_total") and labels.get("kind", "train") == "train"}

    ann, ben = Principal("ann", False, alpha, "alpha"), Principal("ben", False, beta, "beta")
    for who, jobs, trials, running_sweeps in ((ann, 2, 0, 2), (ben, 1, 1, 1), (None, 4, 1, 3),
                                              (accounts.ADMIN, 4, 1, 3), (Principal("x", False), 0, 0, 0)):
        got = seen(who)
        assert got[("trainyard_jobs", "queued")] == jobs, who
        assert got.get(("trainyard_queue_depth", "cpu"), 0) == jobs, who
        assert (got[("trainyard_sweep_trials", "queued")], got[("trainyard_sweeps", "running")]) == (
            trials, running_sweeps), who
        assert (("trainyard_jobs_submitted_total", "") in got) == (who is None or who.admin), who


def queued(series, device: str) -> float:
    return sum(v for n, labels, v in series if n == "trainyard_queue_depth" and labels["device"] == device)


@pytest.mark.slow
def test_a_users_fleet_and_metrics_show_nothing_of_another_projects_jobs(live):
    svc, team = live
    with team.client("ann") as ann:
        waiting = ok(ann.post("/jobs", json={**slow_job(epochs=2), "device": "cuda:7"}), 201)  # no such worker
        running = ok(ann.post("/jobs", json=slow_job(epochs=300)), 201)
        deadline = time.monotonic() + 120
        while not (ok(ann.get(f"/jobs/{running['id']}"))["latest_metrics"] or {}).get("samples_per_s"):
            assert time.monotonic() < deadline, "the job never reported an epoch"
            time.sleep(0.3)
    try:
        ada, ann_view, ben = scrape(team, "ada"), scrape(team, "ann"), scrape(team, "ben")
        job_ids = {labels.get("job_id") for _, labels, _ in ada}
        assert str(running["id"]) in job_ids and str(running["id"]) in {lb.get("job_id") for _, lb, _ in ann_view}
        assert not any(labels.get("job_id") for _, labels, _ in ben)
        assert queued(ada, "cuda:7") == 1 and queued(ann_view, "cuda:7") == 1 and queued(ben, "cuda:7") == 0

        def jobs_in(series, state: str) -> float:
            return sum(v for n, labels, v in series if n == "trainyard_jobs" and labels["state"] == state)
        assert jobs_in(ada, "running") >= 1 and jobs_in(ann_view, "running") == 1 and jobs_in(ben, "running") == 0
        assert jobs_in(ben, "queued") == 0 and sum(v for n, _, v in ben if n == "trainyard_jobs") == 0
        names = {n for n, _, _ in ben}
        assert "trainyard_workers_alive" in names and "trainyard_worker_heartbeat_age_seconds" in names
        for kept_for_the_service in ("trainyard_jobs_submitted_total", "trainyard_storage_bytes"):
            assert kept_for_the_service in {n for n, _, _ in ada} and kept_for_the_service not in names

        for user, expected in (("ann", running["id"]), ("ada", running["id"]), ("ben", None)):
            with team.client(user) as c:
                assert [w["job_id"] for w in ok(c.get("/workers"))] == [expected], user
                devices = ok(c.get("/devices"))
                assert [w["job_id"] for w in devices["cpu"]["workers"]] == [expected], user
                assert [w["job_id"] for h in devices["hosts"] for w in h["cpu"]["workers"]] == [expected], user

        with team.client("ada") as ada_c:
            worker = ok(ada_c.get("/workers"))[0]["id"]
            assert ok(ada_c.post(f"/workers/{worker}/drain"))["draining"] is True
            assert ok(ada_c.post(f"/workers/{worker}/undrain"))["draining"] is False
            ok(ada_c.post("/storage/collect"))
            audit = ok(ada_c.get("/admin/audit", params={"limit": 5}))
            assert [(e["action"], e["target"], e["actor"], e["client"]) for e in audit[:3]] == [
                ("collect", "storage", "ada", "127.0.0.1"), ("undrain", f"worker {worker}", "ada", "127.0.0.1"),
                ("drain", f"worker {worker}", "ada", "127.0.0.1")]
    finally:
        with team.client("ann") as ann:
            for job in (waiting, running):
                ann.post(f"/jobs/{job['id']}/cancel")


def cli(svc: Service, token: str, *args: str) -> subprocess.CompletedProcess:
    env = {**svc.env, "TRAINYARD_API_TOKEN": token}  # TRAINYARD_URL is the service's
    return subprocess.run([str(TRAINYARD), *args], env=env, capture_output=True, text=True, timeout=120)


def out(r: subprocess.CompletedProcess):
    assert r.returncode == 0, (r.args, r.stdout, r.stderr)
    return json.loads(r.stdout)


@pytest.mark.slow
def test_the_admin_flow_through_the_cli(live):
    svc, team = live
    assert out(cli(svc, ROOT, "whoami", "--json")) == {"user": "admin", "admin": True, "project": None}
    made = out(cli(svc, ROOT, "projects", "add", "delta", "--share", "3", "--limit", "devices=4", "--json"))
    assert (made["share"], made["limits"]) == (3.0, {"devices": 4})
    assert out(cli(svc, ROOT, "users", "add", "dan", "--json"))["name"] == "dan"
    assert out(cli(svc, ROOT, "projects", "member-add", "delta", "dan", "--json"))["members"] == ["dan"]
    issued = out(cli(svc, ROOT, "users", "token", "dan", "--project", "delta", "--label", "ci", "--json"))
    assert out(cli(svc, issued["token"], "whoami", "--json")) == {"user": "dan", "admin": False, "project": "delta"}
    changed = out(cli(svc, ROOT, "projects", "set", "delta", "--limit", "queued_jobs=7", "--limit", "devices=",
                      "--json"))
    assert changed["limits"] == {"queued_jobs": 7}
    bad = cli(svc, ROOT, "projects", "set", "delta", "--limit", "gpus=1", "--json")
    assert bad.returncode == 1 and json.loads(bad.stderr)["error"]["detail"][0]["loc"] == ["body", "limits", "gpus"]
    assert [p["name"] for p in out(cli(svc, ROOT, "projects", "list", "--json"))][-1] == "delta"
    users = {u["name"]: u for u in out(cli(svc, ROOT, "users", "list", "--json"))}
    assert [t["label"] for t in users["dan"]["tokens"]] == ["ci"]
    assert out(cli(svc, ROOT, "users", "revoke", str(issued["id"]), "--json")) == {"revoked": issued["id"]}
    refused = cli(svc, issued["token"], "whoami", "--json")
    assert refused.returncode == 1 and json.loads(refused.stderr)["error"]["status_code"] == 401
    forbidden = cli(svc, team.tokens["ann"], "users", "list", "--json")
    assert forbidden.returncode == 1 and json.loads(forbidden.stderr)["error"]["status_code"] == 403
    out(cli(svc, ROOT, "projects", "member-remove", "delta", "dan", "--json"))

    audit = out(cli(svc, ROOT, "audit", "--limit", "7", "--json"))
    assert [e["action"] for e in audit] == ["member_remove", "token_revoke", "project_set", "token_issue",
                                            "member_add", "user_add", "project_add"]
    assert {(e["actor"], e["client"]) for e in audit} == {("admin", "127.0.0.1")}
    assert [e["target"] for e in out(cli(svc, ROOT, "audit", "--action", "user_add", "--limit", "1", "--json"))] == [
        "user dan"]
    # And for people: tables through a pipe, whole lines.
    text = cli(svc, ROOT, "audit", "--limit", "3")
    assert text.returncode == 0 and "member_remove" in text.stdout and "project delta" in text.stdout
    assert "dan" in cli(svc, ROOT, "users", "list").stdout
    assert "delta" in cli(svc, ROOT, "projects", "list").stdout
    assert "ann: a user, acting in project alpha" in cli(svc, team.tokens["ann"], "whoami").stdout
