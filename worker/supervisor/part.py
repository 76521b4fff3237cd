"""A job's ranks on a host other than rank 0's (a job across hosts, app/fleet/spread.py): the part leader runs them.

The part leader is the first worker of this host that the job borrowed. Its job process is the first of
this host's ranks and forks the others (worker/distributed.py); they meet rank 0's at its address. Rank
0's worker owns the job: it renews the lease and records progress and the end. Here the supervisor only:

- reads the job's fence every FENCE_CHECK_S: a job cancelled, failed or taken over (its lease ran out)
  stops this host's ranks at once;
- records a rank's own error as the job's failure (fenced: the first ending recorded stands);
- heartbeats, which is how rank 0's worker knows this host is still there (spread.lost_hosts);
- stops its ranks when the database cannot be reached for a lease (LeaseWatch on the fence reads): rank 0's
  worker has ended the run by then, and may be running it elsewhere;
- holds them to the host-memory budget, as any job process (an `oom` failure past it).

Its log is this host's own (logs/<id>.part.log, not published): the job's log is rank 0's. Torch-free.
"""
import logging
import time

from sqlalchemy.exc import OperationalError

from trainyard.app.core.states import ErrorRecord, Failure, error_record
from trainyard.app.jobs import queue
from trainyard.app.records import Job
from trainyard.worker.supervisor import launch
from trainyard.worker.supervisor.job_run import JobRun, Outcome
from trainyard.worker.supervisor.supervise import FENCE_CHECK_S, LeaseWatch, watched

log = logging.getLogger("trainyard.worker")


def run_part(worker: launch.Launcher, job: Job) -> None:
    """Run this host's ranks of a job across hosts until they end or the job is no longer theirs."""
    settings = worker.settings
    try:
        plan = worker.plan(job)
    except Exception as exc:
        worker.db(queue.fail, job.id, job.claim, error_record(Failure.JOB, type(exc).__name__, str(exc)))
        return
    log_path = settings.layout.log(job.id).with_name(f"{job.id}.part.log")
    run = launch.start(worker, plan, log_path, publish=False)
    run.log(f"ranks {', '.join(map(str, plan.local_ranks))} of job {job.id} (run {job.claim}) on {worker.id} "
            f"({worker.device}); they meet rank 0 at {plan.master}; job process pid {run.proc.pid}")
    log.info("job %s: running its ranks %s on this host", job.id, plan.local_ranks)
    try:
        watched(run, _supervise_part)
    except OperationalError:  # the database gone for longer than its retries: stop the ranks, serve on
        log.exception("database unreachable while running ranks of job %s; stopping them", job.id)
        run.stop_now()
    run.end_processes()
    run.conn.close()
    launch.remove_scratch(settings, plan)
    run.sum_up()
    launch.evict_copies(settings, job.id)


def _supervise_part(run: JobRun, lease: LeaseWatch | None) -> None:
    node = run.worker.settings.node
    next_fence = time.monotonic()
    while True:
        _handle(run, node, wait=max(0.0, next_fence - time.monotonic()))  # events wake it; else the next check
        if run.outcome is not None:
            return
        if lease is not None and lease.lapsed:
            return run.lost("the database could not be reached for a lease")
        if not run.proc.is_alive():
            _handle(run, node)
            if run.outcome is None and run.stop_reason == "memory":
                run.child_died()  # its host-memory budget: oom
            elif run.outcome is None:
                code = run.proc.exitcode
                run.fail(error_record(Failure.INFRASTRUCTURE, "RankLost", f"host {node}: the process of ranks "
                                      f"{', '.join(map(str, run.plan.local_ranks))} ended ({_how(code)}) "
                                      "without reporting"))
            return
        now = time.monotonic()
        # A shutdown: the ranks vote to stop and rank 0 checkpoints. The timeout is rank 0's worker's to keep.
        run.check_stops(now, timeout=False)
        if now >= next_fence:
            next_fence = now + FENCE_CHECK_S
            run.check_memory()
            if not run.worker.db(queue.still_ours, run.job.id, run.job.claim):
                return run.lost("ended, or taken over, by rank 0's worker")
            if lease is not None:
                lease.renewed(now)
            run.worker.housekeeping(state="busy", job_id=run.job.id)


def _handle(run: JobRun, node: str, wait: float = 0.0) -> None:
    """This host's ranks' events (waiting up to `wait` s for the first): their log lines; an error (recorded as
    the job's failure); their end."""
    events: list[dict] = []
    try:
        if run.out.wait(run.conn, wait):
            while len(events) < 1000 and run.conn.poll(0):
                events.append(run.conn.recv())
    except (EOFError, OSError):
        pass  # the process is gone, after what it sent: handled below
    for event in events:
        kind = event.get("type")
        if kind == "log":
            run.log(event["line"])
        elif kind == "error":
            error: ErrorRecord = event["error"]  # as the job process built it (worker/runner.py)
            run.log(error.get("traceback") or "")
            run.fail({**error, "message": f"host {node}: {error['message']}"})
        elif kind in ("done", "preempted"):  # rank 0 records the job's end
            run.outcome = Outcome.DONE
            run.log(f"this host's ranks ended ({kind})")
        if run.outcome is not None:
            return


def _how(code: int | None) -> str:
    return f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
