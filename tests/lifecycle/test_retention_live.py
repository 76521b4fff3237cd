"""Retention and the collector beside real workers (app/lifecycle/retention.py, app/lifecycle/collector.py): passes
run by this process
(collector.collect, against the service's own database and store) while jobs checkpoint, after a worker is killed,
after a sweep ends and while a predict job waits for its model. Whatever a pass removes, no job loses what it
resumes from or predicts with, and a pass after the work leaves exactly what the rows reference.

On SQLite with the data directory as the store, and on PostgreSQL with the tests' own S3 server (moto's). The run
jobs are a plugin this module writes and puts on the workers' PYTHONPATH."""
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from tests.helpers.jobs import tiny_job
from tests.helpers.service import Service, probe_plugin, run_job
from trainyard.app.core.settings import Settings
from trainyard.app.core.storage import Store
from trainyard.app.db import jobs, make_engine, read
from trainyard.app.launcher import postgres_schema
from trainyard.app.lifecycle import collector

pytestmark = pytest.mark.slow
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
DAY = 86400.0

PROBES = '''
import os, time

import torch


def stepper(ctx, config):
    """Counts steps, reporting and checkpointing after each; a resumed run goes on from its checkpoint for
    config["more"] steps, then saves a model. A later run waits config["pause_s"] before it restores."""
    if ctx.attempt > 1:
        time.sleep(config["pause_s"])
    state = ctx.restore()
    start = int(state["step"]) if state else 0
    ctx.log(f"starting at step {start}")
    end = start + config["more"] if state else config["steps"]
    for step in range(start + 1, end + 1):
        time.sleep(config["pace_s"])
        ctx.report(step, loss=1.0 / step)
        ctx.checkpoint({"step": step, "weights": torch.full((config["floats"],), float(step))})
        if ctx.should_stop():
            return None
    ctx.save_model({"w": torch.ones(4)})
    return {"started_at": start, "ended_at": end}


def gate(ctx, config):
    """Runs until the file config["path"] exists."""
    while not os.path.exists(config["path"]):
        if ctx.should_stop():
            return None
        time.sleep(0.05)
    return {}
'''


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> Path:
    return probe_plugin(tmp_path_factory.mktemp("probes"), "trainyard_retention_probes", PROBES, ("stepper", "gate"))


@dataclass
class Yard:
    svc: Service
    settings: Settings  # collect_grace_s=0: only what a row references is spared
    engine: Engine
    store: Store
    worker_env: dict[str, str]

    def stored(self) -> set[str]:
        return {e.key for folder in collector.FOLDERS for e in self.store.entries(folder)}

    def collect(self, shift_s: float = 0.0) -> collector.Report:
        return collector.collect(self.engine, self.settings, shift_s)

    def row(self, job_id: int):
        with read(self.engine) as conn:
            return conn.execute(select(jobs).where(jobs.c.id == job_id)).one()

    def files_of(self, job_id: int) -> set[str]:
        """The keys the rows reference for an ended job: its artifact's files, its log and its TensorBoard event
        files (every run's)."""
        artifact = self.row(job_id).artifact_path
        return {k for k in self.stored() if artifact and k.startswith(artifact.rstrip("/") + "/")
                or k.startswith(f"tensorboard/{job_id}/")} | {f"logs/{job_id}.log"}


@contextmanager
def yard(tmp_path, request, backend: str, probes: Path, workers: int = 1) -> Iterator[Yard]:
    """A server and `workers` CPU workers (with the probe plugin), and this process's view of their database and
    store: SQLite and the data directory, or PostgreSQL and a bucket. Only this process's passes run (collect_s is
    a day)."""
    env = {"TRAINYARD_COLLECT_S": str(DAY)}
    worker_env = {"PYTHONPATH": str(probes)}
    if backend == "sqlite":
        with _yard(Service(tmp_path / "data", env=env), Settings(data_dir=tmp_path / "data", collect_grace_s=0),
                   worker_env, workers) as y:
            yield y
        return
    bucket = request.getfixturevalue("bucket")  # this process's AWS_* point at it too
    with postgres_schema("ret") as url:
        svc = Service(tmp_path / "data", url, env={**env, **bucket.env, "TRAINYARD_STORAGE_URL": bucket.url})
        settings = Settings(data_dir=tmp_path / "data", database_url=url, storage_url=bucket.url, collect_grace_s=0)
        with _yard(svc, settings, worker_env, workers) as y:
            yield y


@contextmanager
def _yard(svc: Service, settings: Settings, worker_env: dict[str, str], workers: int) -> Iterator[Yard]:
    engine = make_engine(settings.db_url)
    try:
        svc.start_server()
        for _ in range(workers):
            svc.start_worker("cpu", env=worker_env)
        yield Yard(svc, settings, engine, settings.store, worker_env)
    finally:
        svc.stop()
        engine.dispose()


def current_checkpoint_survives(y: Yard, job_id: int) -> str | None:
    """The job's checkpoint_path, checked to be in the store. Read before and after the listing: the worker deletes
    a checkpoint only once the row names a newer one, so one named on both sides of the listing must be listed."""
    for _ in range(20):
        before = y.row(job_id).checkpoint_path
        listed = {e.key for e in y.store.entries(f"checkpoints/{job_id}")}
        after = y.row(job_id).checkpoint_path
        if before == after:
            assert before is None or before in listed, (before, sorted(listed))
            return before
    raise AssertionError(f"job {job_id}'s checkpoint kept changing")


@pytest.mark.parametrize("backend", BACKENDS)
def test_passes_beside_a_job_checkpointing_every_step_and_its_resume_after_sigkill(tmp_path, request, backend,
                                                                                   probes) -> None:
    with yard(tmp_path, request, backend, probes) as y:
        job_id = y.svc.submit(run_job("stepper", steps=100_000, more=5, pace_s=0.02, floats=2048,
                                    pause_s=3))["id"]
        y.svc.wait_until(lambda: y.row(job_id).checkpoint_path is not None, 120, "a first checkpoint")
        seen = set()
        for _ in range(50):
            y.collect()
            seen.add(current_checkpoint_survives(y, job_id))
            time.sleep(0.05)  # a few of its checkpoints between passes
        assert len(seen) > 20, seen  # the job checkpointed all along: the passes raced its writes
        assert y.row(job_id).state == "running"

        os.kill(y.svc.workers[0].pid, signal.SIGKILL)  # its fork server and the job process end with it
        y.svc.wait_state(job_id, "queued", timeout=60)  # the lease ran out: requeued, to resume
        killed = y.row(job_id)
        at = killed.checkpoint_epoch
        assert at and killed.checkpoint_path
        for shift in (0.0, 0.0, 60 * DAY):  # a queued job's resume point is kept, however old
            y.collect(shift)
            assert current_checkpoint_survives(y, job_id) == killed.checkpoint_path

        y.svc.start_worker("cpu", env=y.worker_env)
        y.svc.wait_until(lambda: y.row(job_id).claim > killed.claim, 60, "the job to be claimed again")
        until = time.monotonic() + 2  # it waits 3 s before it restores: what it resumes from is kept meanwhile
        while time.monotonic() < until:
            y.collect()
            assert current_checkpoint_survives(y, job_id) == killed.checkpoint_path
        done = y.svc.wait_state(job_id, timeout=120)
        assert done["state"] == "succeeded", done
        assert done["result"] == {"started_at": at, "ended_at": at + 5}  # from its last checkpoint, not step 0
        with y.svc.client() as c:
            log = c.get(f"/jobs/{job_id}/logs").text
        assert "starting at step 0" in log and f"starting at step {at}" in log, log

        y.collect()
        final = y.stored()
        assert final == y.files_of(job_id), sorted(final)
        assert not [k for k in final if k.startswith("checkpoints/")]
        assert f"{y.row(job_id).artifact_path.rstrip('/')}/model.safetensors" in final
        with y.svc.client() as c:
            assert c.get(f"/jobs/{job_id}/artifact").status_code == 200


def wait_sweep(y: Yard, sweep_id: int, timeout: float = 180) -> dict:
    with y.svc.client() as c:
        y.svc.wait_until(lambda: c.get(f"/sweeps/{sweep_id}").json()["state"] != "running", timeout,
                         f"sweep {sweep_id} to end")
        return c.get(f"/sweeps/{sweep_id}").json()


def submit_sweep(y: Yard, spec: dict) -> int:
    with y.svc.client() as c:
        r = c.post("/sweeps", json=spec)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def trial_ids(y: Yard, sweep_id: int) -> list[int]:
    with read(y.engine) as conn:
        return list(conn.execute(select(jobs.c.id).where(jobs.c.sweep_id == sweep_id).order_by(jobs.c.id)).scalars())


def by_val_loss(y: Yard, ids: list[int]) -> list[int]:
    """The trials best first: lowest val_loss, then lowest trial number (the sweep's own order among equals)."""
    rows = [y.row(i) for i in ids]
    return [r.id for r in sorted(rows, key=lambda r: (r.result["val_loss"], r.sweep["trial"]))]


LRS = [0.0005, 0.002, 0.008, 0.03, 0.1, 0.3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_ended_sweep_keeps_the_files_of_its_best_k_trials_and_every_row(tmp_path, request, backend, probes) -> None:
    spec = {"job": tiny_job(epochs=2), "method": "grid", "metric": "val_loss", "keep_best": 3, "max_concurrent": 2,
            "parameters": {"train.lr": {"type": "choice", "values": LRS}}}
    with yard(tmp_path, request, backend, probes) as y:
        sweep_id = submit_sweep(y, spec)
        assert wait_sweep(y, sweep_id)["state"] == "succeeded"
        trials = trial_ids(y, sweep_id)
        assert len(trials) == 6 and all(y.row(t).state == "succeeded" for t in trials)
        best = by_val_loss(y, trials)[:3]
        kept = set().union(*(y.files_of(t) for t in best))
        assert all(any(k.endswith("model.safetensors") for k in y.files_of(t)) for t in best)
        before = y.stored()
        assert {f"logs/{t}.log" for t in trials} <= before

        report = y.collect()
        assert report.trials_reclaimed == 3
        assert y.stored() == kept, sorted(y.stored() ^ kept)
        rows = {t: y.row(t) for t in trials}
        assert len(rows) == 6 and {r.state for r in rows.values()} == {"succeeded"}  # the sweep's record stays
        for t, r in rows.items():
            assert (r.reclaimed is None) == (t in best), (t, r.reclaimed)
        with y.svc.client() as c:
            assert len(c.get(f"/sweeps/{sweep_id}/trials").json()) == 6
            assert c.get(f"/sweeps/{sweep_id}").json()["best"]["job_id"] == best[0]
        assert y.collect().deleted_objects == 0  # nothing more goes


def test_a_model_a_waiting_predict_job_names_is_never_collected(tmp_path, request, probes) -> None:
    """A train -> predict chain, and a sweep's trial outside its best 1 that a predict job names: while the
    predict jobs wait (for a job that runs until a gate opens), passes as of now and a year on take neither model;
    once the predict jobs have run, the trial's files go after all."""
    gate = tmp_path / "gate"
    spec = {"job": tiny_job(epochs=2), "method": "grid", "metric": "val_loss", "keep_best": 1,
            "parameters": {"train.lr": {"type": "choice", "values": LRS[:3]}}}
    with yard(tmp_path, request, "sqlite", probes) as y:
        sweep_id = submit_sweep(y, spec)
        assert wait_sweep(y, sweep_id)["state"] == "succeeded"
        ranked = by_val_loss(y, trial_ids(y, sweep_id))
        named, unnamed = ranked[-1], ranked[1]  # both outside the best 1; a predict job names the worst
        trained = y.svc.submit(tiny_job(epochs=3))["id"]
        blocker = y.svc.submit(run_job("gate", path=str(gate)))["id"]
        predicts = [y.svc.submit({"kind": "predict", "model_job": model, "after": [blocker],
                                  "inputs": [[5.1, 3.5, 1.4, 0.2]], "device": "cpu"})["id"]
                    for model in (trained, named)]
        models: dict[int, set[str]] = {named: y.files_of(named) - {f"logs/{named}.log"}}
        deadline = time.monotonic() + 120
        while y.row(blocker).state != "running" or trained not in models:  # the chain: passes as it trains
            assert time.monotonic() < deadline, "the model job and the blocker did not run"
            y.collect()
            assert models[named] <= y.stored()
            if y.row(trained).state == "succeeded":
                models[trained] = y.files_of(trained) - {f"logs/{trained}.log"}
            assert y.row(trained).state in ("queued", "running", "succeeded")
            time.sleep(0.1)
        assert all(any(k.endswith("model.safetensors") for k in keys) for keys in models.values()), models
        for shift in (0.0, 31 * DAY, 365 * DAY):
            report = y.collect(shift)
            assert {y.row(p).state for p in predicts} == {"queued"}
            for keys in models.values():
                assert keys <= y.stored(), sorted(keys - y.stored())
        assert y.row(named).reclaimed is None and y.row(unnamed).reclaimed is not None  # the rule did act
        assert not y.files_of(unnamed) & y.stored()

        gate.touch()
        done = [y.svc.wait_state(p, timeout=120) for p in predicts]
        assert [d["state"] for d in done] == ["succeeded", "succeeded"], done
        report = y.collect()
        assert report.trials_reclaimed == 1 and y.row(named).reclaimed is not None  # no longer named: it goes
        assert not models[named] & y.stored()
        assert models[trained] <= y.stored()
