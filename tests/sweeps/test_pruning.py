"""Pruned trials: a trial is pruned at the epoch it has reached, which its error names and where its metrics end
(the queue's guarded write, on SQLite and PostgreSQL, with the queue playing the worker's part), never after
its last epoch. On the real server and CPU workers a pruned trial's job ends `pruned` with its metrics ending
where it says, its worker stops it, the jobs list filters it, the CLI and /metrics say pruned, and its retry
runs it to its end. Migration 0005 moves the pruned trials of earlier releases (failed, class "pruned") to the
state and back."""
import subprocess
import sys
import time

import pytest
from sqlalchemy import insert, select

from tests.helpers.jobs import tiny_job
from tests.helpers.service import ROOT, live_service
from tests.helpers.sweeps import run_trial, start_sweep, sweep_spec, wait_sweep
from trainyard.app.core.settings import Settings
from trainyard.app.core.states import Failure, error_record
from trainyard.app.db import jobs, make_engine, migrate, write
from trainyard.app.jobs import queue
from trainyard.app.jobs.submit import enqueue
from trainyard.app.records import job_reads, sweep_reads, sweep_results
from trainyard.app.spec import parse_spec
from trainyard.app.sweeps import search, sweep_store

WHY = error_record(Failure.PRUNED, "Pruned", "pruned at epoch 2: test")


def test_a_trial_is_pruned_at_the_epoch_it_has_reached_and_never_after_its_last(engine):
    job = engine_job(engine, epochs=4)
    queue.record_progress(engine, job.id, job.claim, [(1, {"val_loss": 1.0}), (2, {"val_loss": 1.0})], total=4)
    assert queue.prune(engine, job.id, lambda at: error_record(Failure.PRUNED, "Pruned", f"at {at}")) == 2
    got = job_reads.get_job(engine, job.id)
    assert got.state == "pruned" and got.error["class"] == "pruned" and got.error["message"] == "at 2"
    assert got.finished_at is not None and got.errors[-1]["message"] == "at 2"
    # Its worker is fenced out: nothing it sends is recorded, and it learns the job is no longer its own.
    assert not queue.record_progress(engine, job.id, job.claim, [(3, {"val_loss": 1.0})])
    assert not queue.renew(engine, job.id, job.claim, 30) and not queue.still_ours(engine, job.id, job.claim)
    assert [m["epoch"] for m in job_reads.get_metrics(engine, job.id)] == [1, 2]
    assert queue.prune(engine, job.id, lambda at: WHY) is None  # ended: once

    last = engine_job(engine, epochs=2)
    queue.record_progress(engine, last.id, last.claim, [(1, {"val_loss": 1.0}), (2, {"val_loss": 1.0})], total=2)
    assert queue.prune(engine, last.id, lambda at: WHY) is None  # its last epoch is in: it is saving its model
    assert job_reads.get_job(engine, last.id).state == "running"


def engine_job(engine, epochs: int):
    made, _ = enqueue(engine, parse_spec(tiny_job(epochs)))
    job = queue.claim(engine, "w", "cpu", 30)
    assert job is not None and job.id == made.id
    return job


@pytest.fixture
def settings(tmp_path, backend_url):
    return Settings(data_dir=tmp_path / "data", database_url=backend_url, node_name="host-a")


def test_a_trial_that_ran_past_the_judged_epoch_is_pruned_where_it_stands_when_caught(engine, settings):
    spec = sweep_spec(max_trials=3, max_concurrent=1, job=tiny_job(epochs=6),
                      pruner={"type": "median", "startup_trials": 1, "warmup_epochs": 1})
    sweep_store.create(engine, settings, spec)
    s = search.Searcher(engine, settings)
    s.pass_once()
    run_trial(engine, [0.9, 0.6, 0.4, 0.3, 0.2, 0.1])
    s.pass_once()
    bad = run_trial(engine, [1.1, 1.1, 1.1, 1.1], finish=False)  # poor from epoch 2, at epoch 4 when judged
    s.pass_once()
    got = job_reads.get_job(engine, bad.id)
    assert got.state == "pruned"
    assert got.error["message"].startswith("pruned at epoch 4: val_loss 1.1 at epoch 2 is worse than the median")
    assert [m["epoch"] for m in job_reads.get_metrics(engine, bad.id)] == [1, 2, 3, 4]
    assert sweep_store_counts(engine, got.sweep_id)["pruned"] == 1


def sweep_store_counts(engine, sweep_id: int) -> dict:
    return sweep_results.counts(sweep_reads.trials(engine, [sweep_id])[sweep_id])


def test_migration_0005_moves_the_pruned_trials_of_earlier_releases_and_back(backend_url):
    engine = make_engine(backend_url)
    try:
        migrate.upgrade(engine, "0004")
        rows = [("failed", 1, {"class": "pruned", "type": "Pruned", "message": "pruned at epoch 3: ..."}),
                ("failed", 1, {"class": "job", "type": "E", "message": "broken"}),
                ("failed", None, {"class": "pruned", "type": "Pruned", "message": "not a trial"}),
                ("succeeded", 1, None)]
        for state, sweep_id, error in rows:  # only 0004's columns (later revisions add some)
            with write(engine) as conn:
                conn.execute(insert(jobs).values(kind="train", state=state, spec=tiny_job(), device_req="cpu",
                                                 created_at=0, sweep_id=sweep_id, error=error))
        migrate.upgrade(engine)
        assert states(engine) == ["pruned", "failed", "failed", "succeeded"]
        with write(engine) as conn:
            migrate._run(conn, "downgrade", "0004")
        assert states(engine) == ["failed", "failed", "failed", "succeeded"]
    finally:
        engine.dispose()


def states(engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(select(jobs.c.state).order_by(jobs.c.id)).scalars())


live = live_service(workers=2)


@pytest.mark.slow
def test_a_pruned_trial_stops_where_it_says_is_pruned_everywhere_and_runs_to_its_end_on_retry(live):
    epochs = 600
    made = start_sweep(live, job=tiny_job(epochs, batch_size=8), method="grid", max_concurrent=1, seed=1,
                       parameters={"train.lr": {"type": "choice", "values": [0.05, 1e-6]}},
                       pruner={"type": "median", "startup_trials": 1, "warmup_epochs": 5})
    done = wait_sweep(live, made["id"])
    assert done["counts"] == {"queued": 0, "running": 0, "succeeded": 1, "pruned": 1, "failed": 0, "cancelled": 0}
    bad = next(t for t in done["trials"] if t["params"]["train.lr"] == 1e-6)
    assert bad["state"] == "pruned" and bad["failure"] == "pruned"
    with live.client() as c:
        job = c.get(f"/jobs/{bad['job_id']}").json()
        assert job["state"] == "pruned" and job["error"]["class"] == "pruned"
        at = int(job["error"]["message"].split("pruned at epoch ")[1].split(":")[0])
        assert 5 <= at < epochs
        # Its worker let it go (fenced out at its next look, within a heartbeat) and recorded nothing after.
        live.wait_until(lambda: bad["job_id"] not in {w["job_id"] for w in c.get("/workers").json()}, 5,
                        "the pruned trial's worker let go")
        assert "process stopped" in c.get(f"/jobs/{bad['job_id']}/logs").text
        time.sleep(1)
        assert [m["epoch"] for m in c.get(f"/jobs/{bad['job_id']}/metrics").json()] == list(range(1, at + 1))
        assert c.get(f"/jobs/{bad['job_id']}").json()["progress"]["epoch"] == at

        # The jobs list filters it by its state, and failed ones leave it out.
        assert [j["id"] for j in c.get("/jobs", params={"state": "pruned"}).json()["data"]] == [bad["job_id"]]
        assert bad["job_id"] not in [j["id"] for j in c.get("/jobs", params={"state": "failed"}).json()["data"]]
        scrape = c.get("/metrics").text
        assert 'trainyard_sweep_trials{state="pruned"} 1.0' in scrape
        assert 'trainyard_sweep_trials{state="failed"} 0.0' in scrape
        assert 'trainyard_jobs{kind="train",state="pruned"} 1.0' in scrape
    shown = cli(live, "status", str(bad["job_id"]))
    assert shown.returncode == 0 and "pruned" in shown.stdout and "failed" not in shown.stdout, shown
    listed = cli(live, "jobs", "--state", "pruned")
    assert listed.returncode == 0 and "1 of 1 jobs" in listed.stdout and "pruned" in listed.stdout, listed

    # Its retry runs it to its end (outside its sweep's search, which is over).
    with live.client() as c:
        r = c.post(f"/jobs/{bad['job_id']}/retry")
        assert r.status_code == 200 and r.json()["state"] == "queued", r.text
    ended = live.wait_state(bad["job_id"], timeout=120)
    assert ended["state"] == "succeeded" and ended["progress"]["epoch"] == epochs, ended


def cli(svc, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainyard", *args], cwd=ROOT, env={**svc.env, "COLUMNS": "200"},
                          capture_output=True, text=True, timeout=60)
