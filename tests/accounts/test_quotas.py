"""A project's limits at submit (app/accounts/quotas.py) and its stored bytes as the collector measures them
(app/lifecycle/project_storage.py), on both databases: past queued_jobs, running_sweeps or stored_bytes a submit is
refused (409) naming the limit, through the paths that submit (the insert of a job and a batch, a retry, a sweep's,
an upload's); a sweep's trials, other projects, admins and requests of no project are not held back; each kept
object counts for its job's or its upload's project. Over HTTP with the real server and a worker (slow): ann's
third queued job is refused, her job that started frees its place, and a project over stored_bytes is refused
an upload and a sweep once a collector pass has measured it."""
import io
import json
import time

import pytest
from sqlalchemy import delete, insert, select, update

from tests.helpers.jobs import tiny_job
from tests.helpers.service import TERMINAL, live_service
from trainyard.app import accounts
from trainyard.app.accounts import ADMIN, Principal, quotas
from trainyard.app.core.errors import Conflict
from trainyard.app.core.settings import Settings
from trainyard.app.db import jobs, project_usage, read, sweeps, write
from trainyard.app.jobs import queue
from trainyard.app.jobs.submit import enqueue, enqueue_many
from trainyard.app.lifecycle import collector, project_storage
from trainyard.app.spec import SweepSpec, parse_spec
from trainyard.app.sweeps import sweep_admission

GRID = {"job": tiny_job(epochs=1), "method": "grid", "max_concurrent": 1, "metric": "val_loss",
        "parameters": {"train.lr": {"type": "choice", "values": [0.01]}}}
WAITING = {**tiny_job(), "device": "cuda"}  # no worker serves CUDA in the HTTP test: it stays queued


def make_settings(tmp_path, engine, storage_url: str = "") -> Settings:
    return Settings(data_dir=tmp_path / "data", database_url=str(engine.url.render_as_string(hide_password=False)),
                    storage_url=storage_url, collect_grace_s=0)


def team(engine, **limits) -> tuple[Principal, Principal]:
    """ann in project alpha, with these limits; ben in beta, with none."""
    alpha = accounts.add_project(engine, "alpha", limits=limits)["id"]
    beta = accounts.add_project(engine, "beta")["id"]
    return Principal("ann", False, alpha, "alpha"), Principal("ben", False, beta, "beta")


def refused(call, *args) -> str:
    with pytest.raises(Conflict) as e:
        call(*args)
    return str(e.value)


def submits(engine, who: Principal | None, n: int = 1, key: str | None = None) -> list[int]:
    """n queued jobs submitted as who: through the path of POST /jobs (one), or of POST /jobs/batch."""
    spec = parse_spec(tiny_job())
    project, owner = (who.project_id, who.user) if who else (None, None)
    if n == 1:
        return [enqueue(engine, spec, key, project_id=project, owner=owner, who=who)[0].id]
    return [j.id for j in enqueue_many(engine, [spec] * n, [(None, {})] * n, project, owner, who)]


def test_a_project_holding_its_queued_jobs_is_refused_more(engine):
    ann, ben = team(engine, queued_jobs=2)
    first = submits(engine, ann, key="k")[0]
    assert refused(submits, engine, ann, 3) == (
        "project alpha holds 1 queued job: these 3 would pass its limit of 2 (queued_jobs); submit at most 1, "
        "wait for some to start, or ask an admin")
    submits(engine, ann)
    assert refused(submits, engine, ann) == (
        "project alpha holds 2 queued jobs, its limit (queued_jobs); wait for some to start, or ask an admin")
    assert refused(submits, engine, ann, 2).startswith("project alpha holds 2 queued jobs, its limit")
    assert submits(engine, ann, key="k") == [first]  # a submit repeated under its key made nothing: not refused
    accounts.set_project(engine, "alpha", limits={"queued_jobs": 1})  # lowered below what it holds
    assert refused(submits, engine, ann).startswith("project alpha holds 2 queued jobs, over its limit of 1")
    accounts.set_project(engine, "alpha", limits={"queued_jobs": 2})
    # A retry is a submit: the cancelled job does not come back while the project holds its limit.
    cancelled = queue.cancel(engine, first).id
    submits(engine, ann)
    assert refused(queue.retry, engine, cancelled, ann).startswith("project alpha holds 2 queued jobs, its limit")
    # A job that starts no longer holds a place in the queue.
    assert queue.claim(engine, "w1", "cpu", 30) is not None
    assert queue.retry(engine, cancelled, ann).state == "queued"
    assert refused(submits, engine, ann).startswith("project alpha holds 2 queued jobs, its limit")
    for anyone in (ben, ADMIN, None, Principal("ada", True, ann.project_id, "alpha"), Principal("x", False)):
        submits(engine, anyone, 3)


def test_a_project_with_its_running_sweeps_is_refused_another(engine, tmp_path):
    ann, ben = team(engine, running_sweeps=1)
    settings, spec = make_settings(tmp_path, engine), SweepSpec.model_validate(GRID)
    sweep_admission.admit(engine, settings, spec, ann)
    with write(engine) as conn:
        sweep = conn.execute(insert(sweeps).values(state="running", spec=GRID, created_at=time.time(), trial_count=0,
                                                   project_id=ann.project_id, owner="ann").returning(sweeps.c.id)
                             ).scalar_one()
    said = refused(sweep_admission.admit, engine, settings, spec, ann)
    assert said == ("project alpha has 1 running sweep, its limit of 1 (running_sweeps); wait for one to end, "
                    "cancel one, or ask an admin")
    sweep_admission.admit(engine, settings, spec, ben)
    sweep_admission.admit(engine, settings, spec, ADMIN)
    with write(engine) as conn:
        conn.execute(update(sweeps).where(sweeps.c.id == sweep).values(state="cancelled"))
    quotas.check_sweep(engine, ann)


def test_a_project_storing_its_limit_is_refused_jobs_sweeps_and_uploads(engine):
    ann, ben = team(engine, stored_bytes=1000)
    for check in (quotas.check_storage, quotas.check_sweep):
        check(engine, ann)  # nothing measured yet
    with write(engine) as conn:
        project_storage.record(conn, {ann.project_id: (1000, 2), ben.project_id: (10**12, 9)})
    assert refused(quotas.check_storage, engine, ann) == (
        "project alpha stores 1,000 bytes as last measured, at or over its limit of 1,000 bytes (stored_bytes); "
        "delete jobs, sweeps or datasets it no longer needs (the collector measures again at its next pass), "
        "or ask an admin")
    assert "(stored_bytes)" in refused(submits, engine, ann)
    assert "(stored_bytes)" in refused(submits, engine, ann, 2)
    assert "(stored_bytes)" in refused(quotas.check_sweep, engine, ann)
    for anyone in (ben, ADMIN):
        submits(engine, anyone)
    with write(engine) as conn:
        project_storage.record(conn, {ann.project_id: (999, 2)})
    quotas.check_storage(engine, ann)
    assert project_storage.stored(engine) == {ann.project_id: 999}  # beta's row went: it stores nothing now


def put(settings: Settings, key: str, body: bytes) -> int:
    path = settings.layout.root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)
    settings.store.publish(path)
    return len(body)


def job(engine, project_id: int | None, state: str, **values) -> int:
    job_id = enqueue(engine, parse_spec(tiny_job()), project_id=project_id)[0].id
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(state=state, claim=1, **values))
    return job_id


@pytest.mark.parametrize("remote", [False, True])
def test_the_collector_measures_what_each_project_stores(engine, tmp_path, remote, request):
    storage_url = f"s3://{request.getfixturevalue('bucket').name}/yard" if remote else ""
    settings = make_settings(tmp_path, engine, storage_url)
    ann, ben = team(engine)
    alpha, beta = ann.project_id, ben.project_id
    done, nobodys = (job(engine, p, "succeeded", finished_at=time.time()) for p in (alpha, None))
    running = job(engine, beta, "running")
    with write(engine) as conn:
        for j in (done, nobodys):
            conn.execute(update(jobs).where(jobs.c.id == j).values(artifact_path=f"artifacts/{j}/run-1"))
    upload = json.dumps({"id": "u1", "project_id": alpha}).encode()
    a = sum(put(settings, key, body) for key, body in (
        (f"artifacts/{done}/run-1/model.safetensors", b"m" * 300), (f"artifacts/{done}/run-1/export.onnx", b"o" * 70),
        (f"logs/{done}.log", b"l" * 9), ("datasets/uploads/u1/data.npz", b"d" * 500),
        ("datasets/uploads/u1/meta.json", upload)))
    b = (put(settings, f"artifacts/{running}/run-1/epoch.json", b"e" * 40)
         + put(settings, f"checkpoints/{running}/run-1-e00001-s000001.pt", b"c" * 800))
    put(settings, f"artifacts/{nobodys}/run-1/model.safetensors", b"n" * 1000)
    put(settings, "datasets/uploads/u0/data.npz", b"d" * 50)
    put(settings, "datasets/uploads/u0/meta.json", json.dumps({"id": "u0"}).encode())
    collector.collect(engine, settings)
    with read(engine) as conn:
        rows = {r.project_id: (r.bytes, r.objects) for r in conn.execute(select(project_usage))}
    assert rows == {alpha: (a, 5), beta: (b, 2)}
    assert project_storage.stored(engine) == {alpha: a, beta: b}
    # beta's job deleted: its files go at the next pass, and beta, storing nothing, has no row.
    with write(engine) as conn:
        conn.execute(delete(jobs).where(jobs.c.id == running))
    collector.collect(engine, settings)
    assert project_storage.stored(engine) == {alpha: a}


# A server with a CPU worker and the team (ann in alpha, ben in beta, ada an admin), on SQLite.
live = live_service(env={"TRAINYARD_API_TOKEN": "ops-quotas"}, team=True)


def wait(c, job_id: int, states=TERMINAL, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while (job := c.get(f"/jobs/{job_id}").json())["state"] not in states:
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']}"
        time.sleep(0.2)
    return job


@pytest.mark.slow
def test_over_http_a_project_past_its_limits_is_refused_naming_them(live):
    svc, team_ = live
    with team_.client("ann") as ann, team_.client("ben") as ben, team_.client("ada") as ada:
        r = ada.patch("/admin/projects/alpha", json={"limits": {"queued_jobs": 2}})
        assert r.status_code == 200, r.text
        held = ann.post("/jobs", json=WAITING)
        ran = ann.post("/jobs", json=tiny_job())
        assert held.status_code == ran.status_code == 201, (held.text, ran.text)
        assert wait(ann, ran.json()["id"])["state"] == "succeeded"  # it started: its place in the queue is free
        assert ann.post("/jobs", json=WAITING).status_code == 201
        third = ann.post("/jobs", json=WAITING)
        assert third.status_code == 409, third.text
        assert third.json()["detail"] == ("project alpha holds 2 queued jobs, its limit (queued_jobs); wait for "
                                          "some to start, or ask an admin")
        assert ann.post("/jobs/batch", json=[WAITING]).status_code == 409
        assert ben.post("/jobs", json=WAITING).status_code == 201   # another project
        assert ada.post("/jobs", json=WAITING).status_code == 201   # an admin
        # stored_bytes: once a pass has measured alpha's files (its job's model and log), its upload and sweep wait.
        assert ada.patch("/admin/projects/alpha", json={"limits": {"stored_bytes": 1}}).status_code == 200
        assert ada.post("/storage/collect").status_code == 200
        stored = {p["name"]: p["stored_bytes"] for p in ada.get("/admin/projects").json()}
        assert stored["alpha"] > 0 and stored["beta"] == 0, stored
        up = ann.post("/datasets", files={"file": ("x.csv", io.BytesIO(b"a,label\n1,x\n2,y\n"), "text/csv")})
        assert up.status_code == 409 and "(stored_bytes)" in up.json()["detail"], up.text
        sweep = ann.post("/sweeps", json=GRID)
        assert sweep.status_code == 409 and "(stored_bytes)" in sweep.json()["detail"], sweep.text
        assert ben.post("/sweeps", json=GRID).status_code == 201
