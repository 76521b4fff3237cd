"""Sweeps and uploaded datasets belong to projects (issue 26), over HTTP with a real server and a CPU worker, on
SQLite and PostgreSQL: ann's sweep and its trials, and ann's uploaded CSV, are ann's project's; ben (another
project) gets 404 on each, exactly as for one that does not exist, sees none of them in lists, and a job or sweep
of his naming ann's upload is refused as naming a missing dataset; the admin sees all; the audit record holds
every action of the test and none of the refused ones."""
import io
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from tests.helpers.backends import on_both_backends, on_postgres_only, on_sqlite_only
from tests.helpers.data import iris_csv
from tests.helpers.jobs import tiny_job
from tests.helpers.teams import make_team, service_engine
from trainyard.app import accounts, uploads
from trainyard.app.accounts import audit
from trainyard.app.core.errors import NotFound
from trainyard.app.core.settings import Settings
from trainyard.app.db import jobs, projects, read
from trainyard.app.records import sweep_reads
from trainyard.app.spec import SweepSpec
from trainyard.app.sweeps import sweep_store

service_backend = on_both_backends()
MISSING = 2**31 - 1  # an id never given (MAX_ID itself is a 500 on PostgreSQL: its id columns are int4)


@pytest.fixture
def team(service):
    service.start_worker("cpu")
    return make_team(service)


def wait_sweep(c, sweep_id: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = c.get(f"/sweeps/{sweep_id}").json()
        if s["state"] != "running" and not (s["counts"]["queued"] or s["counts"]["running"]):
            return s
        time.sleep(0.1)
    raise AssertionError(f"sweep {sweep_id} still running after {timeout} s: {s}")


def missing_alike(r, kind: str, given, missing) -> None:
    """r (for `given`) answers exactly as the same request for an id that does not exist (`missing`)."""
    assert r.status_code == missing.status_code == 404, (r.text, missing.text)
    assert r.json() == {**missing.json(), "detail": missing.json()["detail"].replace(str(MISSING), str(given))}, \
        (kind, r.text, missing.text)


def test_sweeps_are_read_within_the_project_and_trials_admitted_as_their_owner(engine, backend_url, tmp_path):
    settings = Settings(data_dir=tmp_path / "data", database_url=backend_url)
    for project in ("alpha", "beta"):
        accounts.add_project(engine, project)
    for user, project in (("ann", "alpha"), ("ben", "beta")):
        accounts.add_user(engine, user)
        accounts.add_member(engine, user, project)
    accounts.add_user(engine, "ada", admin=True)
    ann, ben = (accounts.authenticate(engine, accounts.issue_token(engine, u, p)["token"])
                for u, p in (("ann", "alpha"), ("ben", "beta")))
    ada = accounts.authenticate(engine, accounts.issue_token(engine, "ada", "alpha")["token"])
    assert ann is not None and ben is not None and ada is not None
    spec = SweepSpec.model_validate({"job": tiny_job(), "method": "grid",
                                     "parameters": {"train.lr": {"type": "choice", "values": [0.01, 0.05]}}})
    made = {who.user: sweep_store.create(engine, settings, spec, who) for who in (ann, ada)}
    made["admin"] = sweep_store.create(engine, settings, spec)  # the service's own caller: the admin, no project
    assert sweep_reads.page(engine, who=ben) == ([], 0)
    assert [s.id for s in sweep_reads.page(engine, who=ann)[0]] == [made["ada"].id, made["ann"].id]
    assert sweep_reads.page(engine, who=accounts.ADMIN)[1] == sweep_reads.page(engine)[1] == 3
    for read_one in (sweep_reads.get, sweep_reads.get_summary, sweep_reads.visible):
        with pytest.raises(NotFound, match=f"sweep {made['ann'].id} not found"):
            read_one(engine, made["ann"].id, ben)
        with pytest.raises(NotFound):
            read_one(engine, made["admin"].id, ann)  # no project: the admins' only
        read_one(engine, made["ann"].id, ann)
        read_one(engine, made["admin"].id, ada)
    # The driver admits each trial as the sweep's owner: in its project, an admin only if the owner is one.
    owners = {user: sweep_reads.owner_of(engine, sweep_reads.get(engine, s.id)) for user, s in made.items()}
    assert owners["ann"] == accounts.Principal("ann", False, ann.project_id)
    assert owners["ada"] == accounts.Principal("ada", True, ada.project_id)
    assert owners["admin"] == accounts.Principal("admin", True, None)


def test_uploads_are_read_within_the_project(tmp_path):
    ann, ben = accounts.Principal("ann", False, 1, "alpha"), accounts.Principal("ben", False, 2, "beta")
    mine = uploads.store(io.BytesIO(iris_csv()), "a.csv", tmp_path, "species", who=ann)
    old = uploads.store(io.BytesIO(iris_csv()), "old.csv", tmp_path, "species")  # from before accounts
    assert (mine["project_id"], mine["owner"], old["project_id"], old["owner"]) == (1, "ann", None, None)
    assert [m["id"] for m in uploads.list_all(tmp_path, ann)] == [mine["id"]]
    assert uploads.list_all(tmp_path, ben) == []
    assert {m["id"] for m in uploads.list_all(tmp_path, accounts.ADMIN)} == {mine["id"], old["id"]}
    for who, upload_id in ((ben, mine["id"]), (ann, old["id"])):
        assert not uploads.visible(uploads.get(tmp_path, upload_id), who)
        for act in (uploads.get, uploads.delete):
            with pytest.raises(NotFound, match=f"no uploaded dataset '{upload_id}'"):
                act(tmp_path, upload_id, who=who)
    uploads.delete(tmp_path, mine["id"], who=ann)
    uploads.delete(tmp_path, old["id"], who=accounts.ADMIN)
    assert uploads.list_all(tmp_path) == []


@pytest.mark.slow
@on_postgres_only
def test_a_sweep_and_its_trials_are_its_projects_only(service, team):
    ann, ben, ada = team.client("ann"), team.client("ben"), team.client("ada")
    grid = {"train.lr": {"type": "choice", "values": [0.01, 0.05]}}
    r = ann.post("/sweeps", json={"name": "ann-grid", "job": tiny_job(), "method": "grid", "max_concurrent": 2,
                                  "parameters": grid})
    assert r.status_code == 201, r.text
    made = r.json()
    sid = made["id"]
    assert made["owner"] == "ann"
    # Every sweep route answers ben as for a sweep that does not exist, while it runs and once it has ended.
    for ended in (False, True):
        if ended:
            done = wait_sweep(ann, sid)
            assert done["state"] == "succeeded" and done["counts"]["succeeded"] == 2, done
        for method, path in (("GET", ""), ("GET", "/trials"), ("GET", "/curves"), ("GET", "/events"),
                             ("POST", "/cancel"), ("DELETE", ""), ("DELETE", "?keep=best")):
            theirs = ben.request(method, f"/sweeps/{sid}{path}")
            missing_alike(theirs, path, sid, ben.request(method, f"/sweeps/{MISSING}{path}"))
        listed = ben.get("/sweeps").json()
        assert listed["count"] == 0 and listed["data"] == []
        assert ben.get("/sweeps", params={"state": "succeeded" if ended else "running"}).json()["count"] == 0
        assert [s["id"] for s in ann.get("/sweeps").json()["data"]] == [sid]
        assert [s["owner"] for s in ada.get("/sweeps").json()["data"]] == ["ann"]
        assert ada.get(f"/sweeps/{sid}").json()["owner"] == "ann"
    # Its trials' jobs are ann's, in ann's project.
    trial_ids = [t["job_id"] for t in done["trials"]]
    engine = service_engine(service)
    try:
        with read(engine) as conn:
            alpha = conn.execute(select(projects.c.id).where(projects.c.name == "alpha")).scalar_one()
            rows = conn.execute(select(jobs.c.id, jobs.c.project_id, jobs.c.owner)
                                .where(jobs.c.id.in_(trial_ids))).all()
        assert sorted(rows) == [(i, alpha, "ann") for i in sorted(trial_ids)]
        for job_id in trial_ids:
            assert ann.get(f"/jobs/{job_id}").status_code == 200
            missing_alike(ben.get(f"/jobs/{job_id}"), "job", job_id, ben.get(f"/jobs/{MISSING}"))
        assert not {j["id"] for j in ben.get("/jobs").json()["data"]} & set(trial_ids)
        # A second sweep, cancelled by ann; then the first deleted, keeping its best trial (still ann's).
        r = ann.post("/sweeps", json={"job": tiny_job(epochs=300), "method": "grid", "parameters": grid})
        assert r.status_code == 201, r.text
        second = r.json()["id"]
        assert ann.post(f"/sweeps/{second}/cancel").json()["state"] == "cancelled"
        assert ann.delete(f"/sweeps/{sid}", params={"keep": "best"}).status_code == 204
        assert ann.get(f"/jobs/{done['best']['job_id']}").status_code == 200
        assert ben.get(f"/jobs/{done['best']['job_id']}").status_code == 404
        log = [(e["actor"], e["action"], e["target"], e["client"]) for e in audit.entries(engine)]
    finally:
        engine.dispose()
    sweep_actions = [e for e in log if e[1].startswith("sweep_")]
    assert sweep_actions == [("ann", "sweep_delete", f"sweep {sid}", "127.0.0.1"),
                             ("ann", "sweep_cancel", f"sweep {second}", "127.0.0.1"),
                             ("ann", "sweep_submit", f"sweep {second}", "127.0.0.1"),
                             ("ann", "sweep_submit", f"sweep {sid}", "127.0.0.1")]
    assert not [e for e in log if e[0] == "ben"]  # his refused attempts changed nothing, and are not recorded


@pytest.mark.slow
@on_sqlite_only
def test_an_uploaded_dataset_is_its_projects_only(service, team):
    ann, ben, ada = team.client("ann"), team.client("ben"), team.client("ada")
    r = ann.post("/datasets", files={"file": ("iris.csv", iris_csv())}, data={"label_column": "species"})
    assert r.status_code == 201, r.text
    meta = r.json()
    did = meta["id"]
    assert meta["owner"] == "ann"
    # One from before accounts (no project in its meta.json): the admins' only.
    old = uploads.store(io.BytesIO(iris_csv()), "old.csv", Path(service.env["TRAINYARD_DATA_DIR"]), "species")
    assert [d["id"] for d in ann.get("/datasets").json()["data"]] == [did]
    assert ben.get("/datasets").json() == {"data": [], "count": 0}
    assert sorted(d["id"] for d in ada.get("/datasets").json()["data"]) == sorted([did, old["id"]])
    for dataset_id in (did, old["id"]):
        for method in ("GET", "DELETE"):
            theirs = ben.request(method, f"/datasets/{dataset_id}")
            missing = ben.request(method, "/datasets/doesnotexist")
            assert theirs.status_code == missing.status_code == 404, theirs.text
            assert theirs.json()["detail"] == missing.json()["detail"].replace("doesnotexist", dataset_id)
    assert ann.get(f"/datasets/{old['id']}").status_code == 404
    assert ann.get(f"/datasets/{did}").json() == meta

    # Ben's job or sweep naming ann's upload: refused as naming a missing one.
    job = tiny_job(epochs=1)
    job["data"] = {"dataset": f"upload:{did}"}
    gone = ben.post("/jobs", json={**job, "data": {"dataset": "upload:doesnotexist"}})
    theirs = ben.post("/jobs", json=job)
    assert theirs.status_code == gone.status_code == 422, theirs.text
    assert "does not exist" in theirs.text and did in theirs.text
    sweep = {"job": job, "method": "grid", "parameters": {"train.lr": {"type": "choice", "values": [0.01, 0.05]}}}
    theirs = ben.post("/sweeps", json=sweep)
    assert theirs.status_code == 422 and "does not exist" in theirs.text, theirs.text
    assert ben.get("/sweeps").json()["count"] == 0
    # Ann's own job trains on it; ann deletes it once the job has ended.
    r = ann.post("/jobs", json=job)
    assert r.status_code == 201, r.text
    deadline = time.monotonic() + 120
    while ann.get(f"/jobs/{r.json()['id']}").json()["state"] in ("queued", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert ann.get(f"/jobs/{r.json()['id']}").json()["state"] == "succeeded"
    assert ann.delete(f"/datasets/{did}").status_code == 204
    assert ada.delete(f"/datasets/{old['id']}").status_code == 204
    assert ada.get("/datasets").json()["count"] == 0

    engine = service_engine(service)
    try:
        log = [(e["actor"], e["action"], e["target"], e["client"]) for e in audit.entries(engine)
               if e["action"] in ("upload", "dataset_delete")]
    finally:
        engine.dispose()
    assert log == [("ada", "dataset_delete", f"dataset {old['id']}", "127.0.0.1"),
                   ("ann", "dataset_delete", f"dataset {did}", "127.0.0.1"),
                   ("ann", "upload", f"dataset {did}", "127.0.0.1")]
