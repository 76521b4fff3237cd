"""The worker loop in this process (Worker(burst=True)): claim, plan, supervise, record, for each ending
a job can have. Job processes are real (forked from the worker's fork server); no server, no CLI."""
import pytest
from sqlalchemy import event

from tests.helpers.jobs import slow_job, tiny_job
from trainyard.app.core.settings import Settings
from trainyard.app.db import make_engine, migrate
from trainyard.app.jobs.submit import enqueue
from trainyard.app.records import job_reads
from trainyard.app.spec import parse_spec
from trainyard.worker.supervisor.main import Worker


@pytest.fixture
def settings(tmp_path):
    return Settings(data_dir=tmp_path / "data", lease_s=5, heartbeat_s=0.5)


def submit(settings, body) -> int:
    engine = make_engine(settings.db_url)
    migrate.upgrade(engine)
    job, _ = enqueue(engine, parse_spec(body))
    engine.dispose()
    return job.id


def run_burst(settings, **kw) -> Worker:
    worker = Worker(settings, "cpu", burst=True, **kw)
    assert worker.run() == 0
    return worker


@pytest.mark.slow  # 12 s of jobs run to each ending: the full suite's, not the quick loop's
def test_burst_runs_every_kind_of_ending_then_stops(settings):
    settings.ensure_dirs()
    ok = submit(settings, tiny_job(epochs=3))
    diverges = submit(settings, {**tiny_job(), "model": {"arch": "mlp", "hidden": [256, 256, 256]},
                                 "train": {"epochs": 20, "batch_size": 8, "optimizer": "sgd", "lr": 10.0,
                                           "momentum": 0.99}})
    times_out = submit(settings, {**slow_job(epochs=200), "timeout_s": 1})
    predict = submit(settings, {"kind": "predict", "model_job": ok, "inputs": [[5.1, 3.5, 1.4, 0.2]]})
    orphan = submit(settings, {"kind": "predict", "model_job": times_out, "inputs": [[1.0, 2.0, 3.0, 4.0]]})
    worker = run_burst(settings)
    assert worker.jobs_done == 4  # the orphan waited for its model job, which failed: it never runs
    engine = make_engine(settings.db_url)
    jobs = {i: job_reads.get_job(engine, i) for i in (ok, diverges, times_out, predict, orphan)}
    assert jobs[ok].state == "succeeded" and jobs[ok].epoch == 3 and jobs[ok].artifact_path
    assert [m["epoch"] for m in job_reads.get_metrics(engine, ok)] == [1, 2, 3]
    assert not settings.layout.checkpoints(ok).exists()  # a succeeded job's checkpoints are freed
    assert jobs[diverges].state == "failed" and jobs[diverges].error["class"] == "job"
    assert jobs[times_out].state == "failed" and jobs[times_out].error["class"] == "timeout"
    assert jobs[predict].state == "succeeded" and jobs[predict].result["predictions"] == 1
    assert (settings.layout.resolve(jobs[predict].artifact_path) / "result.json").is_file()
    # Its model job was still queued when it was submitted: it waited for it, and failed (class dependency, naming
    # that job) when it failed, before the burst ended.
    assert jobs[orphan].state == "failed" and jobs[orphan].error["class"] == "dependency"
    assert f"job {times_out}" in jobs[orphan].error["message"] and jobs[orphan].started_at is None
    log = settings.layout.log(ok).read_text()
    assert "job process pid" in log and "memory budget" in log and "peak memory" in log


@pytest.mark.slow  # 17 s: the full suite's, not the quick loop's
def test_max_jobs_and_a_worker_that_is_shut_down_mid_job(settings):
    settings.ensure_dirs()
    first, second = submit(settings, tiny_job()), submit(settings, tiny_job())
    assert run_burst(settings, max_jobs=1).jobs_done == 1
    engine = make_engine(settings.db_url)
    assert job_reads.get_job(engine, first).state == "succeeded" and job_reads.get_job(engine, second).state == "queued"

    long = submit(settings, slow_job(epochs=200))
    worker = Worker(settings, "cpu", burst=True)
    original = worker.housekeeping

    def stop_once_running(state, job_id):  # as a SIGTERM would: the flag, seen at the next beat
        if state == "busy" and job_reads.get_job(engine, long).checkpoint_epoch:
            worker.stopping = True
        original(state, job_id)

    worker.housekeeping = stop_once_running
    worker.run()
    back = job_reads.get_job(engine, long)
    assert back.state == "queued" and back.attempt == 0 and back.checkpoint_epoch >= 1
    assert "requeued without using an attempt" in settings.layout.log(long).read_text()


@pytest.mark.slow  # 6 s: the full suite's, not the quick loop's
def test_every_statement_the_worker_sends_is_marked_on_the_network(settings):
    """A running job's LeaseWatch (worker/supervisor/supervise.py) stops it when its host is cut off only if the
    call its supervisor hangs in is marked (Worker.on_the_network): one unmarked statement, the housekeeping's
    sweep for expired leases, once left a cut-off host's job running well past its lease."""
    settings.ensure_dirs()
    job = submit(settings, tiny_job(epochs=3))
    worker = Worker(settings, "cpu", burst=True)
    sent: list[tuple[str, bool]] = []
    event.listen(worker.engine, "before_cursor_execute",
                 lambda conn, cursor, statement, *rest: sent.append((statement, worker.network_call_since is not None)))
    assert worker.run() == 0
    assert job_reads.get_job(make_engine(settings.db_url), job).state == "succeeded"
    registered = next(i for i, (statement, _) in enumerate(sent) if statement.startswith("INSERT INTO workers"))
    # Before it: the schema's check (migrate.prepare), no job running yet.
    assert len(sent) - registered > 20 and [s for s, marked in sent[registered:] if not marked] == []
