"""Accounts hardened (issue 37), against a live server with TRAINYARD_API_TOKEN and a team (tests/teams.py), on
SQLite and PostgreSQL: a privilege field is a strict boolean ("yes" made an admin); an admin deletes a user (their
token is refused at once, their job stays, audited) and takes admin rights back (403 on /admin from the next
request); a token given an expiry is refused once it passes; the dashboard's cookie holds a session of its own,
never the token, and it ends when the token is revoked or at sign-out."""
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
from sqlalchemy import select

from tests.helpers.backends import BACKENDS
from tests.helpers.jobs import tiny_job
from tests.helpers.service import Service, live_service
from tests.helpers.teams import service_engine
from trainyard.app.cli.admin_commands import duration
from trainyard.app.db import read, sessions

ROOT = "accounts-root-s3cret"
TRAINYARD = Path(sys.executable).with_name("trainyard")


# A server with TRAINYARD_API_TOKEN (no worker: queued jobs are enough here) and its team (ann, ben, ada).
live = live_service(workers=0, env={"TRAINYARD_API_TOKEN": ROOT}, backends=BACKENDS, team=True)


def ok(r: httpx.Response, status: int = 200):
    assert r.status_code == status, (r.request.method, r.request.url, r.status_code, r.text)
    return r.json() if r.content else None


def as_token(svc: Service, token: str) -> httpx.Client:
    return httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def member(ada: httpx.Client, name: str, project: str, admin: bool = False, **token) -> dict:
    """A new user in the project, and a token of theirs for it."""
    ok(ada.post("/admin/users", json={"name": name, "admin": admin}), 201)
    ok(ada.put(f"/admin/projects/{project}/members/{name}"))
    return ok(ada.post(f"/admin/users/{name}/tokens", json={"project": project, **token}), 201)


def test_privilege_fields_are_strict_booleans(live):
    """{"admin": "yes"} made an admin (201, and /me said admin: true): a 422 naming the field now."""
    svc, team = live
    with team.client("ada") as ada:
        for value in ("yes", "true", 1, "1", "on", None):
            for method, path in (("POST", "/admin/users"), ("PATCH", "/admin/users/ann")):
                body = {"name": "mal", "admin": value} if method == "POST" else {"admin": value}
                r = ada.request(method, path, json=body)
                assert r.status_code == 422, (method, value, r.text)
                assert r.json()["detail"][0]["loc"] == ["body", "admin"], r.text
        assert "mal" not in [u["name"] for u in ok(ada.get("/admin/users"))]
        assert ok(ada.get("/admin/users"))[0]["admin"] is False  # ann, unchanged
        assert ok(ada.post("/admin/users", json={"name": "mal", "admin": False}), 201)["admin"] is False


def test_deleting_a_user_refuses_their_token_at_once_keeps_their_job_and_is_audited(live):
    svc, team = live
    with team.client("ada") as ada, team.client("ann") as ann:
        issued = member(ada, "dan", "alpha")
        with as_token(svc, issued["token"]) as dan:
            job = ok(dan.post("/jobs", json={**tiny_job(), "name": "dans"}), 201)
            signed_in = httpx.post(f"{svc.url}/session", json={"token": issued["token"]})
            assert signed_in.status_code == 204
            cookie = {"trainyard_token": signed_in.cookies["trainyard_token"]}
            assert httpx.get(f"{svc.url}/me", cookies=cookie).json()["user"] == "dan"

            gone = ok(ada.delete("/admin/users/dan"))
            assert gone == {"name": "dan", "projects": ["alpha"], "tokens": [issued["id"]]}
            assert dan.get("/me").status_code == 401 and dan.get("/jobs").status_code == 401  # at once
            assert httpx.get(f"{svc.url}/me", cookies=cookie).status_code == 401  # their dashboard session too
        kept = ok(ann.get(f"/jobs/{job['id']}"))  # the job stays in the project, under the name
        assert (kept["owner"], kept["state"]) == ("dan", "queued")
        users = {u["name"]: u for u in ok(ada.get("/admin/users"))}
        assert "dan" not in users and "dan" not in ok(ada.get("/admin/projects"))[0]["members"]
        ok(ada.delete("/admin/users/dan"), 404)
        ok(ada.post("/admin/users/dan/tokens", json={"project": "alpha"}), 404)

        assert "TRAINYARD_API_TOKEN" in ok(ada.delete("/admin/users/admin"), 409)["detail"]
        assert "another admin" in ok(ada.delete("/admin/users/ada"), 409)["detail"]
        assert ok(ann.delete("/admin/users/ben"), 403) and ok(ann.get("/me"))["user"] == "ann"
        [entry] = ok(ada.get("/admin/audit", params={"action": "user_delete"}))
        assert (entry["actor"], entry["target"], entry["client"]) == ("ada", "user dan", "127.0.0.1")
        assert entry["detail"] == {"projects": ["alpha"], "tokens": [issued["id"]]}
        ok(ann.post(f"/jobs/{job['id']}/cancel"))


def test_taking_admin_rights_back_refuses_the_admin_routes_from_the_next_request(live):
    svc, team = live
    with team.client("ada") as ada:
        in_beta = member(ada, "eve", "beta", admin=True)
        across = ok(ada.post("/admin/users/eve/tokens", json={"label": "all projects"}), 201)
        with as_token(svc, in_beta["token"]) as eve, as_token(svc, across["token"]) as eve_across:
            assert ok(eve.get("/admin/users")) and ok(eve_across.get("/admin/users"))
            demoted = ok(ada.patch("/admin/users/eve", json={"admin": False}))
            assert demoted["admin"] is False and [t["id"] for t in demoted["tokens"]] == [in_beta["id"]]
            r = eve.get("/admin/users")
            assert r.status_code == 403 and "not an admin" in r.json()["detail"], r.text
            assert ok(eve.get("/me")) == {"user": "eve", "admin": False, "project": "beta"}  # a member's now
            assert ok(eve.get("/jobs"))["count"] == 0
            assert eve_across.get("/me").status_code == 401  # an admin's token of no project: revoked
            assert eve.patch("/admin/users/eve", json={"admin": True}).status_code == 403  # not by themself

            assert ok(ada.patch("/admin/users/eve", json={"admin": True}))["admin"] is True
            assert ok(eve.get("/admin/users"))
            assert eve_across.get("/me").status_code == 401  # revoked stays revoked
        assert "another admin" in ok(ada.patch("/admin/users/ada", json={"admin": False}), 409)["detail"]
        ok(ada.patch("/admin/users/admin", json={"admin": False}), 409)
        ok(ada.patch("/admin/users/nobody", json={"admin": True}), 404)
        changes = ok(ada.get("/admin/audit", params={"action": "user_set"}))
        assert [(e["target"], e["detail"]) for e in changes] == [
            ("user eve", {"admin": True, "revoked": []}), ("user eve", {"admin": False, "revoked": [across["id"]]})]


def test_a_token_given_an_expiry_is_refused_once_it_passes(live):
    svc, team = live
    with team.client("ada") as ada:
        for bad in (0, -5, "60", 1.5, 10**12, True):
            r = ada.post("/admin/users/ann/tokens", json={"project": "alpha", "expires_in_s": bad})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "expires_in_s"], (bad, r.text)
        issued = ok(ada.post("/admin/users/ann/tokens", json={"project": "alpha", "expires_in_s": 2}), 201)
        with as_token(svc, issued["token"]) as short:
            assert ok(short.get("/me"))["user"] == "ann"
            signed_in = httpx.post(f"{svc.url}/session", json={"token": issued["token"]})
            assert signed_in.status_code == 204
            [anns] = [u["tokens"] for u in ok(ada.get("/admin/users")) if u["name"] == "ann"]
            assert [(t["id"], t["expires_at"]) for t in anns] == [(anns[0]["id"], None),  # the team's: never
                                                                   (issued["id"], issued["expires_at"])]
            assert issued["expires_at"] is not None
            deadline = time.monotonic() + 10
            while short.get("/me").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.25)
            assert short.get("/me").status_code == 401 and short.get("/jobs").status_code == 401
            # The session it signed in ends with it, and the token leaves the list.
            assert httpx.get(f"{svc.url}/me", cookies=signed_in.cookies).status_code == 401
            assert issued["id"] not in {t["id"] for u in ok(ada.get("/admin/users")) for t in u["tokens"]}
    with team.client("ann") as ann:
        assert ok(ann.get("/me"))["user"] == "ann"  # her other token is untouched


def test_the_cli_issues_a_token_that_expires_and_deletes_and_demotes_users(live):
    svc, team = live
    assert [duration(d) for d in ("30d", "12h", "45m", "90s", "3600")] == [2592000, 43200, 2700, 90, 3600]

    def cli(*args: str) -> dict:
        env = {**svc.env, "TRAINYARD_API_TOKEN": ROOT}
        done = subprocess.run([str(TRAINYARD), *args, "--json"], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return json.loads(done.stdout)

    with team.client("ada") as ada:
        ok(ada.post("/admin/users", json={"name": "fay", "admin": True}), 201)
        issued = cli("users", "token", "fay", "--expires", "12h")
        listed = {t["id"]: t for u in ok(ada.get("/admin/users")) for t in u["tokens"]}
        assert listed[issued["id"]]["expires_at"] == issued["expires_at"] is not None
        with as_token(svc, issued["token"]) as fay:
            assert ok(fay.get("/me"))["user"] == "fay"
            assert cli("users", "set", "fay", "--no-admin")["admin"] is False
            assert fay.get("/me").status_code == 401  # an admin's token of no project: revoked with the rights
        assert cli("users", "delete", "fay") == {"name": "fay", "projects": [], "tokens": []}  # none live
        bad = subprocess.run([str(TRAINYARD), "users", "token", "ann", "--expires", "soon"], env=svc.env,
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "30d, 12h" in bad.stderr
        audit = ok(ada.get("/admin/audit", params={"actor": "admin", "limit": 3}))
        assert [e["action"] for e in audit] == ["user_delete", "user_set", "token_issue"]
        assert audit[2]["detail"]["expires_at"] is not None


def test_the_sign_in_cookie_holds_a_session_not_the_token_and_ends_with_the_token(live):
    """The cookie held the raw token for 30 days: now a session id, stored as a digest, that revoking the token or
    signing out ends."""
    svc, team = live
    with team.client("ada") as ada:
        issued = ok(ada.post("/admin/users/ben/tokens", json={"project": "beta", "label": "browser"}), 201)
    token = issued["token"]
    r = httpx.post(f"{svc.url}/session", json={"token": token})
    assert r.status_code == 204
    cookie = r.cookies["trainyard_token"]
    assert cookie.startswith("tys_") and token not in r.headers["set-cookie"] and token[4:] not in cookie
    with httpx.Client(base_url=svc.url, cookies={"trainyard_token": cookie}) as browser:
        assert ok(browser.get("/me"))["user"] == "ben"
        engine = service_engine(svc)
        try:
            with read(engine) as conn:
                stored = [tuple(row) for row in conn.execute(select(sessions))]
        finally:
            engine.dispose()
        assert stored and not any(cookie in map(str, row) or token in map(str, row) for row in stored)
        # The raw token is no cookie of ours: it signs no one in.
        assert httpx.get(f"{svc.url}/me", cookies={"trainyard_token": token}).status_code == 401

        with team.client("ada") as ada:
            ok(ada.delete(f"/admin/tokens/{issued['id']}"), 204)
        assert browser.get("/me").status_code == 401 and browser.get("/jobs").status_code == 401  # at once

    # The admin's token signs in to a session too, and signing out ends it (a copy of the cookie is refused).
    r = httpx.post(f"{svc.url}/session", json={"token": ROOT})
    admin_cookie = {"trainyard_token": r.cookies["trainyard_token"]}
    assert ROOT not in r.headers["set-cookie"]
    assert ok(httpx.get(f"{svc.url}/me", cookies=admin_cookie))["admin"] is True
    assert httpx.delete(f"{svc.url}/session", cookies=admin_cookie).status_code == 204
    assert httpx.get(f"{svc.url}/me", cookies=admin_cookie).status_code == 401


def test_a_sweep_is_never_its_deleted_owners_namesake(engine):
    """A running sweep admits its trials as its owner: a user deleted and the name given to a new admin must not
    make the old sweep an admin's (past the project's limits)."""
    from typing import cast

    from sqlalchemy import select

    from trainyard.app import accounts
    from trainyard.app.core.states import SweepState
    from trainyard.app.db import db_now, read
    from trainyard.app.records import Sweep, SweepPlan, sweep_reads
    accounts.add_project(engine, "vision")
    accounts.add_user(engine, "dan", admin=True)
    with read(engine) as conn:
        now = conn.execute(select(db_now())).scalar_one()
    project_id = accounts.get_project(engine, "vision")["id"]
    sweep = Sweep(1, None, SweepState.RUNNING, now, None, None, 0, cast(SweepPlan, None), project_id=project_id,
                  owner="dan")
    assert sweep_reads.owner_of(engine, sweep).admin  # dan, an admin when the sweep was made
    accounts.delete_user(engine, "dan", actor="admin")
    accounts.add_user(engine, "dan", admin=True)  # a new person, an admin, by the old name
    assert not sweep_reads.owner_of(engine, sweep).admin
