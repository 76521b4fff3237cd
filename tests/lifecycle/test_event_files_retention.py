"""A job's TensorBoard event files (tensorboard/<id>/) under the retention rules and the collector: kept while the job
runs, keeps its log, holds its model or holds the checkpoint a retry resumes from; gone with the last of those (a
log past its TTL with a checkpoint past its own, an expired job's row) and with no row at all; counted in the job's
project."""
import time

from sqlalchemy import update

from tests.helpers.jobs import tiny_job
from trainyard.app.core.settings import Settings
from trainyard.app.db import jobs, write
from trainyard.app.jobs.submit import enqueue
from trainyard.app.lifecycle import collector, project_storage
from trainyard.app.spec import parse_spec

DAY = 86400.0


def a_job(engine, state: str, ended_days_ago: float | None = None, **values) -> int:
    job_id = enqueue(engine, parse_spec(tiny_job()))[0].id
    finished = time.time() - ended_days_ago * DAY if ended_days_ago is not None else None
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(
            state=state, claim=1, finished_at=finished,
            **{k: v.format(id=job_id) if isinstance(v, str) else v for k, v in values.items()}))
    return job_id


def events_of(settings: Settings, job_id: int) -> str:
    """Write an event file of the job's first run; its key."""
    folder = settings.layout.tensorboard(job_id)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "events.out.tfevents.1700000000.host.1.0.run-1"
    path.write_bytes(b"\x00" * 100)
    return settings.layout.rel(path)


def test_event_files_are_kept_exactly_as_long_as_what_a_job_keeps(tmp_path, engine):
    settings = Settings(data_dir=tmp_path / "data", database_url=engine.url.render_as_string(hide_password=False),
                        collect_grace_s=0, checkpoint_ttl_s=7 * DAY, ended_job_ttl_s=30 * DAY, log_ttl_s=7 * DAY)
    running = a_job(engine, "running")
    done = a_job(engine, "succeeded", 0, artifact_path="artifacts/{id}/run-1")
    to_retry = a_job(engine, "failed", 1, checkpoint_path="checkpoints/{id}/run-1-e00001-s000000.pt",
                     checkpoint_epoch=1)
    past_ttl = a_job(engine, "failed", 8, checkpoint_path="checkpoints/{id}/run-1-e00001-s000000.pt",
                     checkpoint_epoch=1)
    expired = a_job(engine, "failed", 31)
    recent = a_job(engine, "cancelled", 0)  # no model, no checkpoint: kept as its log is, to see why it ended
    old_log = a_job(engine, "cancelled", 8)  # its log past log_ttl_s, and nothing else to keep
    ids = (running, done, to_retry, past_ttl, expired, recent, old_log)
    keys = {job_id: events_of(settings, job_id) for job_id in ids}
    orphan = events_of(settings, 424242)  # a job deleted while its store failed
    report = collector.collect(engine, settings)
    kept = {e.key for e in settings.store.entries("tensorboard")}
    assert kept == {keys[running], keys[done], keys[to_retry], keys[recent]}
    assert {keys[past_ttl], keys[expired], keys[old_log], orphan}.isdisjoint(kept)
    assert report.jobs_deleted == 1 and report.checkpoints_dropped >= 1
    assert not settings.layout.tensorboard(expired).exists()  # emptied folders go too
    artifacts = {u.kind: u for u in report.usage}["artifacts"]
    assert (artifacts.bytes, artifacts.objects) == (400, 4)  # they count as the jobs' artifacts


def test_event_files_count_in_their_jobs_project(tmp_path):
    settings = Settings(data_dir=tmp_path / "data")
    keys = [events_of(settings, 5), events_of(settings, 6)]
    entries = [e for e in settings.store.entries("tensorboard") if e.key in keys]
    assert project_storage.measure({5: 1, 6: 2}, settings.store, entries) == {1: (100, 1), 2: (100, 1)}
