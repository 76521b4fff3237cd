"""The collector and the retention rules (app/lifecycle/collector.py, app/lifecycle/retention.py), on both databases,
with the data
directory as the store and with the tests' own S3 server: after a pass the store's keys are exactly those the rows
reference; each rule acts on the rows it names and on no other; what the pass measured is what a listing shows."""
import os
import time

import pytest
from sqlalchemy import func, insert, select, update

from tests.helpers.jobs import tiny_job
from trainyard.app.core.settings import Settings
from trainyard.app.db import counters, jobs, read, sweeps, write
from trainyard.app.jobs.submit import enqueue
from trainyard.app.lifecycle import collector, retention
from trainyard.app.spec import parse_spec

DAY = 86400.0


def make_settings(tmp_path, engine, storage_url: str = "", **rules) -> Settings:
    return Settings(data_dir=tmp_path / "data", database_url=str(engine.url.render_as_string(hide_password=False)),
                    storage_url=storage_url, **{"collect_grace_s": 0, **rules})


def job(engine, state: str, claim: int = 1, ended_days_ago: float | None = None, **values) -> int:
    job_id = enqueue(engine, parse_spec(tiny_job()))[0].id
    with write(engine) as conn:
        finished = time.time() - ended_days_ago * DAY if ended_days_ago is not None else None
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(state=state, claim=claim, finished_at=finished,
                                                                    **values))
    return job_id


def put(settings: Settings, *keys: str, age_s: float = 0.0) -> None:
    """Write each key under the data directory and publish it (to the bucket, when the store is one)."""
    for key in keys:
        path = settings.layout.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(key.encode() * 3)
        if age_s:
            t = time.time() - age_s
            os.utime(path, (t, t))
        settings.store.publish(path)


def stored(settings: Settings) -> set[str]:
    return {e.key for folder in collector.FOLDERS for e in settings.store.entries(folder)}


def a_yard(engine, settings: Settings) -> tuple[set[str], set[str]]:
    """Jobs in every state, with their files and some no row references: (the keys to keep, the keys to go)."""
    done = job(engine, "succeeded", claim=2, ended_days_ago=0, artifact_path="artifacts/{id}/run-2",
               checkpoint_path="checkpoints/{id}/run-2-e00002-s000010.pt")
    running = job(engine, "running", claim=3, checkpoint_path="checkpoints/{id}/run-2-e00003-s000000.pt",
                  checkpoint_epoch=3)
    failed = job(engine, "failed", ended_days_ago=1, checkpoint_path="checkpoints/{id}/run-1-e00001-s000005.pt",
                 checkpoint_epoch=1)
    stale = job(engine, "cancelled", ended_days_ago=8, checkpoint_path="checkpoints/{id}/run-1-e00001-s000005.pt",
                checkpoint_epoch=1)
    expired = job(engine, "failed", ended_days_ago=31)
    with write(engine) as conn:  # the paths name their own job
        for table_id in (done, running, failed, stale):
            row = conn.execute(select(jobs.c.artifact_path, jobs.c.checkpoint_path).where(jobs.c.id == table_id)).one()
            conn.execute(update(jobs).where(jobs.c.id == table_id).values(
                artifact_path=row.artifact_path and row.artifact_path.format(id=table_id),
                checkpoint_path=row.checkpoint_path and row.checkpoint_path.format(id=table_id)))
    keep = {f"artifacts/{done}/run-2/model.safetensors", f"artifacts/{done}/run-2/meta.json",
            f"artifacts/{done}/run-2/model.onnx", f"logs/{done}.log",
            f"checkpoints/{running}/run-2-e00003-s000000.pt",        # what it resumed from
            f"checkpoints/{running}/run-3-e00004-s000000.pt",        # its own run's, not recorded yet
            f"checkpoints/{running}/.run-3-e00005-s000000.pt.x1.tmp",  # being written
            f"artifacts/{running}/run-3/.model.safetensors.x2.tmp", f"logs/{running}.log",
            f"checkpoints/{failed}/run-1-e00001-s000005.pt", f"logs/{failed}.log", f"logs/{stale}.log",
            "datasets/uploads/abc/data.npz", "datasets/uploads/abc/meta.json"}
    go = {f"checkpoints/{done}/run-2-e00002-s000010.pt",             # succeeded: not needed
          f"artifacts/{done}/run-1/model.safetensors",               # a stale run's
          f"checkpoints/{running}/run-2-e00002-s000000.pt",          # superseded
          f"checkpoints/{stale}/run-1-e00001-s000005.pt",            # past checkpoint_ttl_s
          f"logs/{expired}.log", f"artifacts/{expired}/run-1/model.safetensors",  # past ended_job_ttl_s
          "artifacts/999/run-1/model.safetensors", "logs/999.log",   # a job deleted by a crash's halfway
          "datasets/uploads/half/data.npz"}                          # an upload that never got its meta.json
    put(settings, *keep, *go)
    return keep, go


def check_pass(engine, settings: Settings) -> None:
    keep, go = a_yard(engine, settings)
    report = collector.collect(engine, settings)
    assert stored(settings) == keep
    assert report.deleted_objects == len(go) and report.jobs_deleted == 1 and report.checkpoints_dropped >= 2
    with read(engine) as conn:
        left: dict[str, int] = dict(conn.execute(select(jobs.c.state, func.count()).group_by(jobs.c.state)).all())
        assert left == {"succeeded": 1, "running": 1, "failed": 1, "cancelled": 1}
        dropped = conn.execute(select(jobs.c.checkpoint_path, jobs.c.checkpoint_epoch)
                               .where(jobs.c.state == "cancelled")).one()
        assert tuple(dropped) == (None, None)  # a retry starts over
        assert conn.execute(select(counters.c.value).where(
            counters.c.name == "trainyard_storage_collections_total")).scalar_one() == 1
    # What it measured is what a listing shows, kind by kind.
    listing = settings.store.entries("artifacts") + settings.store.entries("checkpoints") + \
        settings.store.entries("logs") + settings.store.entries("datasets/uploads")
    measured = {u.kind: (u.bytes, u.objects) for u in collector.usage(engine)}
    for kind in ("artifacts", "checkpoints", "exports", "logs", "uploads"):
        mine = [e for e in listing if collector.kind_of(e.key) == kind]
        assert measured[kind] == (sum(e.size for e in mine), len(mine)), kind
    # A second pass finds nothing more; a month later the exports go (made again on request), the models stay.
    assert collector.collect(engine, settings).deleted_objects == 0
    collector.collect(engine, settings, shift_s=8 * DAY)
    assert not any(k.endswith("model.onnx") for k in stored(settings))
    assert any(k.endswith("run-2/model.safetensors") for k in stored(settings))


def test_a_pass_leaves_exactly_the_referenced_keys(engine, tmp_path):
    check_pass(engine, make_settings(tmp_path, engine))


def test_a_pass_on_a_bucket_leaves_exactly_the_referenced_keys(engine, tmp_path, bucket):
    settings = make_settings(tmp_path, engine, f"s3://{bucket.name}/yard")
    check_pass(engine, settings)


def test_the_grace_period_spares_young_orphans(engine, tmp_path):
    settings = make_settings(tmp_path, engine, collect_grace_s=600)
    put(settings, "artifacts/77/run-1/model.safetensors")
    put(settings, "artifacts/78/run-1/model.safetensors", age_s=3600)
    collector.collect(engine, settings)
    assert stored(settings) == {"artifacts/77/run-1/model.safetensors"}
    assert not (settings.layout.root / "artifacts" / "78").exists()  # the emptied folders go too


def test_zero_ttls_keep_for_ever_and_pinned_jobs_keep_everything(engine, tmp_path):
    settings = make_settings(tmp_path, engine, checkpoint_ttl_s=0, ended_job_ttl_s=0, log_ttl_s=0, export_ttl_s=0)
    old = job(engine, "failed", ended_days_ago=400, checkpoint_path="checkpoints/1/run-1-e00001-s000001.pt")
    pinned = job(engine, "cancelled", ended_days_ago=400, pinned=True)
    put(settings, "checkpoints/1/run-1-e00001-s000001.pt", f"logs/{old}.log", f"logs/{pinned}.log")
    collector.collect(engine, settings, shift_s=400 * DAY)
    assert stored(settings) == {"checkpoints/1/run-1-e00001-s000001.pt", f"logs/{old}.log", f"logs/{pinned}.log"}
    rules = retention.Rules.of(make_settings(tmp_path, engine))  # the defaults: the pinned one still stays
    retention.apply(engine, rules, time.time())
    with read(engine) as conn:
        assert set(conn.execute(select(jobs.c.id)).scalars()) == {pinned}


def test_an_ended_sweep_keeps_its_best_k_trials_files(engine, tmp_path):
    settings = make_settings(tmp_path, engine)
    spec = {"job": tiny_job(), "method": "random", "metric": "val_loss", "keep_best": 2,
            "parameters": {"train.lr": {"type": "float", "low": 0.001, "high": 0.1}}}
    with write(engine) as conn:
        sweep_id = conn.execute(insert(sweeps).values(name="s", state="running", spec=spec, created_at=0,
                                                      trial_count=5).returning(sweeps.c.id)).scalar_one()
    losses = [0.5, 0.1, 0.4, 0.2, None]  # the last one failed
    trials = []
    for n, loss in enumerate(losses):
        trial = job(engine, "succeeded" if loss is not None else "failed", ended_days_ago=0, sweep_id=sweep_id,
                    sweep={"id": sweep_id, "trial": n, "params": {}}, result={"val_loss": loss} if loss else None)
        with write(engine) as conn:
            conn.execute(update(jobs).where(jobs.c.id == trial).values(
                artifact_path=f"artifacts/{trial}/run-1" if loss else None))
        put(settings, f"logs/{trial}.log", *([f"artifacts/{trial}/run-1/model.safetensors"] if loss else []))
        trials.append(trial)
    collector.collect(engine, settings)
    assert len(stored(settings)) == 9  # a running sweep keeps all
    with write(engine) as conn:
        conn.execute(update(sweeps).values(state="succeeded", finished_at=time.time()))
    report = collector.collect(engine, settings)
    best = {trials[1], trials[3]}
    assert report.trials_reclaimed == 3
    assert stored(settings) == {k for t in best for k in (f"logs/{t}.log", f"artifacts/{t}/run-1/model.safetensors")}
    with read(engine) as conn:
        rows = {r.id: r for r in conn.execute(select(jobs.c.id, jobs.c.reclaimed, jobs.c.artifact_path))}
    assert len(rows) == 5  # the rows stay, as the sweep's record
    for t in trials:
        assert (rows[t].reclaimed is None) == (t in best), t
        assert (rows[t].artifact_path is None) == (t not in best)
    assert "best 2" in rows[trials[0]].reclaimed["why"]


@pytest.mark.parametrize("state", ["queued", "running"])
def test_a_job_still_to_run_keeps_its_resume_checkpoint(engine, tmp_path, state):
    settings = make_settings(tmp_path, engine, checkpoint_ttl_s=1)
    key = "checkpoints/{}/run-1-e00001-s000001.pt"
    j = job(engine, state, claim=1, ended_days_ago=10)
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == j).values(checkpoint_path=key.format(j), checkpoint_epoch=1))
    put(settings, key.format(j), f"logs/{j}.log")
    collector.collect(engine, settings, shift_s=60 * DAY)
    assert stored(settings) == {key.format(j), f"logs/{j}.log"}
