"""Deleting jobs, sweeps and datasets (app/lifecycle/deletion.py, app/lifecycle/references.py): rows and stored
objects gone, the id
answering 404 after; each kind of reference answering 409 naming it, the thing kept; and a worker whose job was
deleted under it fenced out, writing nothing more.

The queue-level tests run on both databases; the HTTP ones run the real server and worker on SQLite with the data
directory as the store, and on PostgreSQL with the tests' own S3 server."""
import re
import time
from contextlib import contextmanager

import pytest
from sqlalchemy import delete, func, insert, select, update

from tests.helpers.jobs import enqueued, slow_job, tiny_job
from tests.helpers.service import Service
from trainyard.app.core.errors import Conflict, NotFound
from trainyard.app.core.layout import Layout
from trainyard.app.core.storage import Store
from trainyard.app.db import job_sweeps, jobs, metrics, read, sweeps, write
from trainyard.app.jobs import queue
from trainyard.app.launcher import postgres_schema
from trainyard.app.lifecycle import deletion, references
from trainyard.app.records import job_reads


def rows_of(engine, job_id: int) -> tuple[int, int]:
    with read(engine) as conn:
        return (conn.execute(select(func.count()).select_from(jobs).where(jobs.c.id == job_id)).scalar_one(),
                conn.execute(select(func.count()).select_from(metrics).where(metrics.c.job_id == job_id)).scalar_one())


def refused(engine, store, job_id: int, *words: str) -> None:
    with pytest.raises(Conflict) as caught:
        deletion.delete_job(engine, store, job_id)
    assert all(w in str(caught.value) for w in words), str(caught.value)
    assert rows_of(engine, job_id)[0] == 1  # kept


def test_each_reference_keeps_a_job_and_names_itself(engine, tmp_path):
    store = Store(Layout(tmp_path / "data"))
    model = enqueued(engine, tiny_job()).id
    refused(engine, store, model, f"job {model} is queued")
    job = queue.claim(engine, "w", "cpu", 30)
    assert job is not None and queue.record_epoch(engine, job.id, job.claim, 1, {"val_loss": 0.9})
    refused(engine, store, model, f"job {model} is running")
    assert queue.succeed(engine, job.id, job.claim, {"val_loss": 0.5}, f"artifacts/{model}/run-1")

    assert deletion.pin(engine, model).pinned
    refused(engine, store, model, "pinned", f"/jobs/{model}/unpin")
    assert not deletion.pin(engine, model, False).pinned

    predict = enqueued(engine, {"kind": "predict", "model_job": model, "inputs": [[5.1, 3.5, 1.4, 0.2]],
                                "device": "cpu"}).id
    refused(engine, store, model, f"job {model} is the model_job of job {predict}, which is queued")
    queue.cancel(engine, predict)
    warm = enqueued(engine, {**tiny_job(), "init_from": model}).id
    refused(engine, store, model, f"the init_from of job {warm}")
    queue.cancel(engine, warm)
    waiting = enqueued(engine, tiny_job()).id  # `after` read from the stored spec, whoever adds it to the spec
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == waiting).values(spec={  # and a name that is no id, passed over
            **tiny_job(), "after": [model, 10**6], "init_from": "sweep:9:best"}))
    refused(engine, store, model, f"the after of job {waiting}")
    queue.cancel(engine, waiting)

    deletion.delete_job(engine, store, model)  # every reference ended: it goes
    assert rows_of(engine, model) == (0, 0)
    with pytest.raises(NotFound):
        job_reads.get_job(engine, model)
    with pytest.raises(NotFound):
        deletion.delete_job(engine, store, model)
    for ended in (predict, warm, waiting):  # a cancelled job names nothing any more
        deletion.delete_job(engine, store, ended)


def test_the_best_trial_of_a_running_sweep_is_kept(engine, tmp_path):
    store = Store(Layout(tmp_path / "data"))
    with write(engine) as conn:
        sweep_id = conn.execute(insert(sweeps).values(state="running", spec={"metric": "val_loss"}, created_at=0,
                                                      trial_count=2).returning(sweeps.c.id)).scalar_one()
    made = []
    for trial, loss in enumerate((0.2, 0.7)):
        job_id = enqueued(engine, tiny_job()).id
        with write(engine) as conn:
            conn.execute(update(jobs).where(jobs.c.id == job_id).values(
                sweep_id=sweep_id, sweep={"id": sweep_id, "trial": trial, "params": {}}))
        job = queue.claim(engine, "w", "cpu", 30)
        assert job is not None and queue.succeed(engine, job.id, job.claim, {"val_loss": loss}, None)
        made.append(job_id)
    best, worse = made
    refused(engine, store, best, f"best trial of sweep {sweep_id}, which is running")
    deletion.delete_job(engine, store, worse)  # only the best is kept
    with pytest.raises(Conflict, match="running; cancel it first"):
        deletion.delete_sweep(engine, store, sweep_id)
    waiting = enqueued(engine, tiny_job()).id  # as one naming "sweep:<id>:best" waits until the sweep's end is seen
    with write(engine) as conn:
        conn.execute(update(sweeps).where(sweeps.c.id == sweep_id).values(state="succeeded"))
        conn.execute(insert(job_sweeps).values(job_id=waiting, sweep_id=sweep_id, field="model_job"))
    with pytest.raises(Conflict, match=f"job {waiting} waits for the best trial of sweep {sweep_id}"):
        deletion.delete_sweep(engine, store, sweep_id)
    with write(engine) as conn:
        conn.execute(delete(job_sweeps))
    assert deletion.delete_sweep(engine, store, sweep_id, keep_best=True) == best
    assert job_reads.get_job(engine, best).sweep_id is None  # detached, kept
    with pytest.raises(NotFound):
        deletion.delete_sweep(engine, store, sweep_id)


def test_a_dataset_a_queued_job_uses_is_kept(engine):
    job_id = enqueued(engine, {**tiny_job(), "data": {"dataset": "upload:abc123"}}).id
    with read(engine) as conn:
        assert references.why_dataset_kept(conn, "abc123") == \
            f"dataset abc123 is used by job {job_id}, which is queued; cancel it or wait for it to end"
        assert references.why_dataset_kept(conn, "abc12") is None
    queue.cancel(engine, job_id)
    with read(engine) as conn:
        assert references.why_dataset_kept(conn, "abc123") is None


def test_only_the_jobs_own_objects_go(tmp_path):
    store = Store(Layout(tmp_path / "data"))
    keys = ["artifacts/1/run-1/model.safetensors", "artifacts/1/run-2/model.onnx", "checkpoints/1/run-2-e1-s0.pt",
            "logs/1.log", "scratch/1/run-2/x", "artifacts/10/run-1/meta.json", "checkpoints/11/run-1.pt",
            "logs/10.log", "datasets/uploads/1/data.npz"]
    for key in keys:
        (store.layout.root / key).parent.mkdir(parents=True, exist_ok=True)
        (store.layout.root / key).write_bytes(b"x")
    deletion.delete_objects(store, [1])
    assert sorted(str(p.relative_to(store.layout.root)) for p in store.layout.root.rglob("*") if p.is_file()) == \
        sorted(keys[5:])


def test_writes_of_a_worker_whose_job_was_deleted_under_it_change_nothing(engine):
    """The race a delete's running check prevents, forced (as a lease that ran out under it would): every fenced
    write of the worker still running it matches nothing, and none brings a row back."""
    job_id = enqueued(engine, tiny_job()).id
    job = queue.claim(engine, "w", "cpu", 30)
    assert job is not None and queue.record_epoch(engine, job_id, job.claim, 1, {"val_loss": 0.9})
    with write(engine) as conn:
        deletion.delete_rows(conn, [job_id], guarded=False)
    assert deletion.gone(engine, job_id)
    claim = job.claim
    assert not queue.still_ours(engine, job_id, claim)
    assert not queue.renew(engine, job_id, claim, 30)
    assert not queue.record_progress(engine, job_id, claim, [(2, {"val_loss": 0.8})], (2, "checkpoints/x.pt"), 5)
    assert not queue.start_over(engine, job_id, claim)
    assert queue.fail(engine, job_id, claim, {"class": "infrastructure", "type": "X", "message": "late"}) is None
    assert not queue.requeue_preempted(engine, job_id, claim)
    assert not queue.succeed(engine, job_id, claim, {"val_loss": 0.1}, "artifacts/x")
    assert rows_of(engine, job_id) == (0, 0)


# ---- over HTTP, real server and worker -------------------------------------------------------------------------

OBJECT_FOLDERS = ("artifacts", "checkpoints", "logs", "scratch")


@contextmanager
def live(tmp_path, request, backend: str):
    if backend == "sqlite":
        svc = Service(tmp_path / "data")
        root = tmp_path / "data"
        with _running(svc):
            yield svc, lambda: sorted(str(p.relative_to(root)) for folder in OBJECT_FOLDERS
                                      for p in (root / folder).rglob("*") if p.is_file())
        return
    bucket = request.getfixturevalue("bucket")
    with postgres_schema("del") as url:
        svc = Service(tmp_path / "data", url, env={**bucket.env, "TRAINYARD_STORAGE_URL": bucket.url})
        with _running(svc):
            yield svc, lambda: [k.removeprefix("trainyard/") for k in bucket.keys()
                                if k.removeprefix("trainyard/").startswith(OBJECT_FOLDERS)]


@contextmanager
def _running(svc: Service):
    try:
        svc.start_server()
        svc.start_worker("cpu")
        yield
    finally:
        svc.stop()


def of_job(keys: list[str], job_id: int) -> list[str]:
    return [k for k in keys if k.startswith((f"artifacts/{job_id}/", f"checkpoints/{job_id}/", f"scratch/{job_id}/"))
            or k == f"logs/{job_id}.log"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_delete_over_http_with_real_workers(tmp_path, request, backend):
    with live(tmp_path, request, backend) as (svc, keys), svc.client() as c:
        done = [svc.wait_state(svc.submit(tiny_job(epochs=3))["id"]) for _ in range(2)]
        assert [d["state"] for d in done] == ["succeeded", "succeeded"]
        gone, other = done[0]["id"], done[1]["id"]
        assert c.get(f"/jobs/{gone}/artifact").status_code == 200
        before = keys()
        assert of_job(before, gone) and f"logs/{gone}.log" in before, before

        assert c.post(f"/jobs/{gone}/pin").json()["pinned"] is True
        r = c.delete(f"/jobs/{gone}")
        assert r.status_code == 409 and "pinned" in r.json()["detail"], r.text
        assert c.get(f"/jobs/{gone}").json()["pinned"] is True
        assert c.post(f"/jobs/{gone}/unpin").json()["pinned"] is False

        running = svc.submit(slow_job(epochs=200))["id"]
        svc.wait_state(running, ("running",))  # the one worker is busy: the next job stays queued
        predict = svc.submit({"kind": "predict", "model_job": gone, "inputs": [[5.1, 3.5, 1.4, 0.2]],
                              "device": "cpu"})["id"]
        for job_id, words in ((running, f"job {running} is running"),
                              (gone, f"the model_job of job {predict}, which is queued")):
            r = c.delete(f"/jobs/{job_id}")
            assert r.status_code == 409 and words in r.json()["detail"], r.text
        assert c.post(f"/jobs/{running}/cancel").status_code == 200
        svc.wait_state(predict)

        assert c.delete(f"/jobs/{gone}").status_code == 204
        for path in (f"/jobs/{gone}", f"/jobs/{gone}/metrics", f"/jobs/{gone}/logs", f"/jobs/{gone}/artifact"):
            assert c.get(path).status_code == 404, path
        assert c.delete(f"/jobs/{gone}").status_code == 404
        after = keys()
        assert of_job(after, gone) == [] and sorted(set(before) - set(after)) == of_job(before, gone)
        assert c.get(f"/jobs/{other}/artifact").status_code == 200  # another job's are untouched

        svc.wait_state(running)
        time.sleep(1)  # the worker's last writes about the cancelled job
        assert c.delete(f"/jobs/{running}").status_code == 204
        assert of_job(keys(), running) == []


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_delete_a_sweep_keeping_its_best_trial(tmp_path, request, backend):
    spec = {"job": tiny_job(epochs=2), "parameters": {"train.lr": {"type": "choice", "values": [0.001, 0.1]}},
            "method": "grid", "metric": "val_loss", "max_concurrent": 2}
    with live(tmp_path, request, backend) as (svc, keys), svc.client() as c:
        sweep = c.post("/sweeps", json=spec).json()
        r = c.delete(f"/sweeps/{sweep['id']}")
        assert r.status_code == 409 and "running" in r.json()["detail"], r.text
        deadline = time.monotonic() + 120
        while (found := c.get(f"/sweeps/{sweep['id']}").json())["state"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.3)
        assert found["state"] == "succeeded", found
        best = found["best"]["job_id"]
        trials = [t["job_id"] for t in found["trials"]]
        assert len(trials) == 2 and best in trials

        assert c.post(f"/jobs/{best}/pin").status_code == 200  # a pinned trial keeps the whole sweep
        r = c.delete(f"/sweeps/{sweep['id']}")
        assert r.status_code == 409 and f"job {best} is pinned" in r.json()["detail"], r.text
        assert c.get(f"/sweeps/{sweep['id']}").status_code == 200
        r = c.delete(f"/sweeps/{sweep['id']}", params={"keep": "best"})
        assert r.status_code == 204, r.text
        assert c.get(f"/sweeps/{sweep['id']}").status_code == 404
        kept = c.get(f"/jobs/{best}").json()
        assert kept["state"] == "succeeded" and kept["sweep"]["id"] == sweep["id"]  # its history, detached
        assert c.get("/jobs", params={"sweep": sweep["id"]}).json()["count"] == 0
        for job_id in trials:
            if job_id != best:
                assert c.get(f"/jobs/{job_id}").status_code == 404
                assert of_job(keys(), job_id) == []
        assert of_job(keys(), best)
        assert c.delete(f"/sweeps/{sweep['id']}").status_code == 404


def test_a_dataset_delete_over_http_names_the_job_using_it(service):
    from tests.helpers.data import iris_csv
    with service.client() as c:  # no worker: the job stays queued
        upload = c.post("/datasets", files={"file": ("iris.csv", iris_csv())}, data={"label_column": "species"})
        assert upload.status_code == 201, upload.text
        dataset = upload.json()["id"]
        job = service.submit({**tiny_job(), "data": {"dataset": f"upload:{dataset}"}})
        r = c.delete(f"/datasets/{dataset}")
        assert r.status_code == 409 and f"used by job {job['id']}, which is queued" in r.json()["detail"], r.text
        assert c.get(f"/datasets/{dataset}").status_code == 200
        c.post(f"/jobs/{job['id']}/cancel")
        assert c.delete(f"/datasets/{dataset}").status_code == 204


def test_unknown_ids_answer_404(service):
    with service.client() as c:
        assert c.delete("/jobs/12345").status_code == 404
        assert c.post("/jobs/12345/pin").status_code == 404
        assert c.delete("/sweeps/12345").status_code == 404
        assert c.delete("/sweeps/1", params={"keep": "worst"}).status_code == 422


@pytest.mark.slow
def test_a_worker_whose_running_job_is_deleted_under_it_stops_and_leaves_nothing(tmp_path):
    """The race (or a lease that ran out) forced: the job's rows deleted while its worker runs it, the running
    check bypassed. The worker stops the job process, records nothing about it and removes what the run left."""
    from trainyard.app.core.settings import Settings
    from trainyard.app.db import make_engine
    with live(tmp_path, None, "sqlite") as (svc, keys), svc.client() as c:
        engine = make_engine(svc.env["TRAINYARD_DATABASE_URL"] or Settings(data_dir=svc.data_dir).db_url)
        job_id = svc.submit(slow_job(epochs=200))["id"]
        svc.wait_until(lambda: (c.get(f"/jobs/{job_id}").json()["checkpoint_epoch"] or 0) >= 1, 60, "a checkpoint")
        assert of_job(keys(), job_id)
        with write(engine) as conn:
            deletion.delete_rows(conn, [job_id], guarded=False)
        deletion.delete_objects(Store(Layout(svc.data_dir)), [job_id])
        after = svc.wait_state(svc.submit(tiny_job())["id"], timeout=60)  # the worker is free: it stopped the job
        assert after["state"] == "succeeded"
        time.sleep(1)
        assert rows_of(engine, job_id) == (0, 0) and c.get(f"/jobs/{job_id}").status_code == 404
        assert of_job(keys(), job_id) == [], keys()
        engine.dispose()


@pytest.mark.slow  # 6 s of CLI processes: the full suite's, not the quick loop's
def test_the_cli_pins_unpins_and_deletes(service):
    import subprocess
    import sys

    from tests.helpers.service import ROOT

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trainyard", *args], cwd=ROOT, capture_output=True, text=True,
                              env={**service.env, "COLUMNS": "200"}, timeout=60)
    job = service.submit(tiny_job())["id"]
    r = cli("delete", str(job))
    assert r.returncode == 1 and f"job {job} is queued; cancel it first" in r.stderr, r
    assert cli("cancel", str(job)).returncode == 0
    assert cli("pin", str(job)).returncode == 0
    r = cli("delete", str(job))
    assert r.returncode == 1 and "pinned" in r.stderr, r
    assert cli("unpin", str(job)).returncode == 0
    r = cli("delete", str(job))
    assert r.returncode == 0 and f"deleted job {job}" in r.stdout, r
    r = cli("sweep-delete", "777")
    assert r.returncode == 1 and "sweep 777 not found" in r.stderr, r


@pytest.mark.slow
def test_the_dashboard_pins_unpins_and_deletes_an_ended_job_after_a_confirm(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    from pathlib import Path

    from tests.helpers.browser import ARGS, CHROMIUM
    from tests.helpers.service import serving
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed")
    expect = sync_api.expect
    with serving(tmp_path / "data") as svc, sync_api.sync_playwright() as p:
        jid = svc.wait_state(svc.submit(tiny_job())["id"])["id"]
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(15_000)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{svc.url}/#/jobs/{jid}")
            expect(page.get_by_test_id("job-state")).to_have_text("succeeded")
            delete = page.get_by_role("button", name=f"Delete job {jid}")
            expect(delete).to_be_visible()
            page.get_by_role("button", name=f"Pin job {jid}").click()
            expect(page.get_by_role("button", name=f"Unpin job {jid}")).to_be_visible()
            expect(delete).to_be_hidden()  # a pinned job is kept
            assert svc.job(jid)["pinned"] is True
            page.get_by_role("button", name=f"Unpin job {jid}").click()
            expect(delete).to_be_visible()
            page.once("dialog", lambda d: d.dismiss())
            delete.click()
            time.sleep(0.5)
            assert svc.job(jid)["state"] == "succeeded"  # not confirmed: kept
            page.once("dialog", lambda d: d.accept())
            delete.click()
            expect(page).to_have_url(re.compile(r"#/$"))
            with svc.client() as c:
                assert c.get(f"/jobs/{jid}").status_code == 404
            assert errors == []
        finally:
            browser.close()


def test_migration_0006_keeps_every_row_and_ids_are_never_given_again(backend_url):
    """0006 adds `pinned` and (SQLite) copies jobs and sweeps into AUTOINCREMENT tables: their children's rows
    (metrics, sweep_log) survive the copy both ways, and the id of a deleted newest job is not reused."""
    from trainyard.app.db import make_engine, migrate, sweep_log
    engine = make_engine(backend_url)
    try:
        migrate.upgrade(engine, "0005")
        with write(engine) as conn:  # only 0005's columns
            for _ in range(3):
                conn.execute(insert(jobs).values(kind="train", state="succeeded", spec=tiny_job(), device_req="cpu",
                                                 created_at=0))
            conn.execute(insert(metrics).values(job_id=3, epoch=1, attempt=1, data={"val_loss": 1.0}, created_at=0))
            conn.execute(insert(sweeps).values(state="succeeded", spec={}, created_at=0, trial_count=0))
            conn.execute(insert(sweep_log).values(sweep_id=1, seq=0, entry={}))
        migrate.upgrade(engine, "0006")

        def count(table) -> int:
            with read(engine) as conn:
                return conn.execute(select(func.count()).select_from(table)).scalar_one()
        assert (count(jobs), count(metrics), count(sweeps), count(sweep_log)) == (3, 1, 1, 1)
        with write(engine) as conn:
            deletion.delete_rows(conn, [3])
            assert conn.execute(insert(jobs).values(kind="train", state="queued", spec=tiny_job(), device_req="cpu",
                                                    created_at=0).returning(jobs.c.id)).scalar_one() == 4
            assert conn.execute(select(jobs.c.pinned).where(jobs.c.id == 4)).scalar_one() is None
            conn.execute(insert(metrics).values(job_id=4, epoch=1, attempt=1, data={}, created_at=0))
        with write(engine) as conn:
            migrate._run(conn, "downgrade", "0005")
        assert (count(jobs), count(metrics), count(sweeps), count(sweep_log)) == (3, 1, 1, 1)
        migrate.upgrade(engine)
    finally:
        engine.dispose()
