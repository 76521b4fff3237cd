"""Run one claimed job: plan it, start its process from the fork server with its two pipes (events,
and its stdout/stderr), supervise it to its end, and clean up after it. Torch-free.
"""
import logging
import shutil
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Protocol

from sqlalchemy.exc import OperationalError

from trainyard.app.core.settings import Settings
from trainyard.app.core.states import Failure, error_record
from trainyard.app.fleet import spread
from trainyard.app.jobs import queue
from trainyard.app.lifecycle import deletion, host_cache
from trainyard.app.records import Job
from trainyard.worker import fork_server
from trainyard.worker.supervisor import memory
from trainyard.worker.supervisor.job_run import JobRun, Outcome, WorkerLink
from trainyard.worker.supervisor.joblog import widen
from trainyard.worker.supervisor.plan import JobPlan
from trainyard.worker.supervisor.supervise import supervise

log = logging.getLogger("trainyard.worker")


class Launcher(WorkerLink, Protocol):
    """What starting a job needs of its worker, besides what supervising it does."""
    id: str
    device: str
    ctx: ForkServerContext

    def plan(self, job: Job) -> JobPlan: ...


def run_job(worker: Launcher, job: Job) -> None:
    """Run the job in a process of its own until its end is recorded (or it is no longer ours)."""
    settings = worker.settings
    log_path = settings.layout.log(job.id)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fetch_log(settings, job.id)
    try:
        plan = worker.plan(job)
    except Exception as exc:  # e.g. the model job's artifact is gone: the job's own problem
        worker.db(queue.fail, job.id, job.claim, error_record(Failure.JOB, type(exc).__name__, str(exc)))
        return
    run = start(worker, plan, log_path)
    threads = f", {plan.threads} torch threads" if plan.threads else ""
    budget = memory.gib(plan.memory_budget) if plan.memory_budget is not None else "none"
    run.log(f"attempt {job.attempt} (run {job.claim}) on {worker.id} ({worker.device}{threads}, memory budget "
            f"{budget}), job process pid {run.proc.pid}")
    if plan.master:
        run.log(f"ranks across hosts: {spread.describe(job.ranks)}")
    try:
        supervise(run)
    except OperationalError:
        # We can no longer report for this job: stop it. Its lease runs out and the job is
        # requeued (from its last recorded checkpoint) for whichever worker reaches the database.
        log.exception("database unreachable while running job %s; stopping it", job.id)
        run.stop_now()
        # Nor can it check that the job is still its own (publish_log would wait a lease for each
        # check): the log's last lines stay on this host, and the bucket keeps the last heartbeat's.
        run.publish = False
    run.end_processes()
    run.conn.close()
    remove_scratch(settings, plan)
    run.sum_up()
    run.publish_log()  # with the lines written after the job's end was recorded
    if run.outcome == Outcome.LOST and worker.db(deletion.gone, job.id):  # deleted under us: what the run left goes too
        deletion.delete_objects(settings.store, [job.id])
    if run.outcome == Outcome.SUCCEEDED:
        try:
            settings.store.delete_prefix(settings.layout.rel(settings.layout.checkpoints(job.id)))
        except Exception as exc:
            log.warning("job %s: could not delete its checkpoints: %s", job.id, exc)
    evict_copies(settings, job.id)


def remove_scratch(settings: Settings, plan: JobPlan) -> None:
    """A run job's ctx.data_dir goes with its run (worker/supervisor/prepare.py made it)."""
    if plan.scratch_dir is not None:
        shutil.rmtree(settings.layout.scratch(plan.job.id), ignore_errors=True)


def evict_copies(settings: Settings, job_id: int) -> None:
    """What a run fetched and wrote stays on this host as a copy of the bucket's: keep the copies to their cap."""
    if settings.store.remote:
        try:
            host_cache.evict(settings.store, settings.cache_bytes, settings.collect_grace_s)
        except Exception as exc:
            log.warning("job %s: this host's copies of bucket objects not evicted: %s", job_id, exc)


def start(worker: Launcher, plan: JobPlan, log_path: Path, publish: bool = True) -> JobRun:
    """Start the plan's job process from the worker's fork server, with its events pipe and its stdout and
    stderr (a pipe the supervisor copies to log_path, held to its cap: worker/supervisor/joblog.py)."""
    parent_conn, child_conn = worker.ctx.Pipe(duplex=False)
    output, output_w = worker.ctx.Pipe(duplex=False)
    widen(output)
    proc = worker.ctx.Process(target=fork_server.run, name=f"trainyard-job-{plan.job.id}",
                              args=(plan, child_conn, output_w))
    proc.start()
    child_conn.close()
    output_w.close()
    return JobRun(worker=worker, plan=plan, proc=proc, conn=parent_conn, log_path=log_path, output=output,
                  publish=publish)


def fetch_log(settings: Settings, job_id: int) -> None:
    """A job resumed on this host goes on with the log its earlier runs (on other hosts) wrote."""
    store = settings.store
    if store.remote:
        try:
            store.fetch(settings.layout.rel(settings.layout.log(job_id)), refresh=True)
        except FileNotFoundError:
            pass
        except Exception as exc:
            log.warning("job %s: earlier log not fetched from %s: %s", job_id, store.describe(), exc)
