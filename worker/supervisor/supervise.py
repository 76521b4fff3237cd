"""The supervisor's loop over one job process: renew the lease, check the fence, watch its memory, stop
it on shutdown, cancel, timeout or preemption, and turn its events into fenced writes. Torch-free.

What the loop decides is kept on the JobRun (worker/supervisor/job_run.py); a write that changes nothing means
the job is no longer ours, and our copy is stopped at once. A lease that runs out while the database
on the network cannot be reached stops it too, whatever the loop is waiting on (LeaseWatch).
"""
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainyard.app.core.layout import ARTIFACT_FILES
from trainyard.app.core.states import Failure, error_record
from trainyard.app.fleet import preemption, spread
from trainyard.app.fleet.preemption import Fence
from trainyard.app.jobs import queue
from trainyard.app.spec import MAX_META_FILE_BYTES, MAX_METRIC_KEYS, MAX_METRIC_NAME
from trainyard.worker.supervisor.job_run import JobRun, Outcome

log = logging.getLogger("trainyard.worker")

# How often a running job's row is re-read: a cancel must stop the job process within 2 seconds.
FENCE_CHECK_S = 0.25
# How often rank 0's worker looks for the other hosts of a job across hosts (spread.lost_hosts), at most: a host
# silent for a lease ends the run then, so a sixth of a lease more keeps every rank's end within the lease + 2 s.
HOSTS_CHECK_S = 1.0
PROGRESS = ("epoch", "checkpoint", "total")
# While a job's events flow, its pipe is read at most this often: a job finishing a thousand epochs
# a second costs twenty commits a second, not a thousand, and leaves the other cores to training.
GATHER_S = 0.05
# Keys an epoch record may hold besides a report's own: the built-in trainer's and the allocator's.
BUILT_IN_METRIC_KEYS = 24


class LeaseWatch:
    """Stops the job process when its lease has run out while its supervisor is stuck calling the database or
    the bucket on the network (PostgreSQL, S3): its host was cut off, and another worker may take the job now.

    The loop itself cannot be trusted to notice: a call to a database that vanished with the network can
    wait for seconds (libpq's limits, app/db/__init__.py) and then be retried for up to a lease, and a log upload to a
    bucket for as long as botocore's timeouts and retries. So a thread of its own keeps the deadline, reckoned
    from when each renewal that reached the database was asked (the database's new expiry is no earlier), and
    kills the process once it has passed with such a call (worker.on_the_network) under way for half a lease
    or more. A loop that is merely slow (a starved CPU) is left
    alone: its next call reaches the database, and a renewal of a job taken over fails there."""

    def __init__(self, run: JobRun, lease_s: float):
        self.run, self.lease_s = run, lease_s
        self.deadline = run.started + lease_s  # the claim's lease, renewed at the loop's first pass
        self.lapsed = False
        self._closed = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name=f"lease-{run.job.id}").start()

    def renewed(self, asked_at: float) -> None:
        self.deadline = asked_at + self.lease_s

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        wait = max(0.0, self.deadline - time.monotonic())
        while not self._closed.wait(wait):
            now = time.monotonic()
            since = self.run.worker.network_call_since
            if now < self.deadline:
                wait = self.deadline - now
            elif since is not None and now - since >= self.lease_s / 2:
                self.lapsed = True
                log.error("job %s: its lease ran out while the database could not be reached; stopping its "
                          "process (another worker may take the job now)", self.run.job.id)
                try:
                    os.kill(self.run.proc.pid, signal.SIGKILL)  # no join here: the loop's thread reaps it
                except ProcessLookupError:
                    pass
                return
            else:
                wait = self.lease_s / 10


def supervise(run: JobRun) -> None:
    """Watch the job process until its end is recorded, it is lost, or it exits."""
    watched(run, _supervise)


def watched(run: JobRun, loop: Callable[[JobRun, LeaseWatch | None], None]) -> None:
    """Run a supervisor's loop over the job process under a LeaseWatch, then reap the process. SQLite is on this
    host: a call waiting on it waits for a lock, which no other process can use to take the job meanwhile, so
    it gets no watch. A database on the network can be lost with the network."""
    settings = run.worker.settings
    lease = LeaseWatch(run, settings.lease_s) if settings.db_url.startswith("postgresql") else None
    try:
        loop(run, lease)
    finally:
        if lease is not None:
            lease.close()
    run.proc.join(timeout=5)


def _supervise(run: JobRun, lease: LeaseWatch | None) -> None:
    settings = run.worker.settings
    next_fence = next_renew = next_hosts_check = time.monotonic()
    while True:
        # Events wake the loop at once; between them it sleeps until its next check is due, not at a fixed
        # 20 Hz: on a host whose cores all run ranks, each idle wake-up of the worker pre-empts one of them.
        read_events(run, wait=max(0.0, min(next_fence, next_renew) - time.monotonic()))
        if run.outcome is not None:
            break
        if lease is not None and lease.lapsed:
            run.lost("its lease ran out while the database could not be reached")
            break
        if not run.proc.is_alive():
            read_events(run, wait=0)
            if run.outcome is None:
                run.child_died()
            break
        now = time.monotonic()
        run.check_stops(now)
        if now >= next_fence:
            next_fence = now + FENCE_CHECK_S
            run.check_memory()
            fenced = run.db(preemption.fence)
            if fenced == Fence.LOST:
                run.lost()
                break
            if run.plan.master and now >= next_hosts_check:
                next_hosts_check = now + min(HOSTS_CHECK_S, settings.lease_s / 6)
                if lost_host(run):
                    break
            if fenced == Fence.PREEMPT and run.stop_reason is None:  # its device goes to a job of higher priority
                run.begin_stop("preempt", settings.grace_s)
        if now >= next_renew:
            next_renew = now + settings.heartbeat_s
            if not run.db(queue.renew, settings.lease_s):
                run.lost()
                break
            if lease is not None:
                lease.renewed(now)
            run.worker.housekeeping(state="busy", job_id=run.job.id)
            run.publish_log(held=True)


def lost_host(run: JobRun) -> bool:
    """A job across hosts whose other hosts' ranks are gone (their worker stopped heartbeating for a lease:
    killed, or cut off) ends now as `infrastructure`, retried from its last checkpoint: its collectives
    would otherwise wait for them until they time out."""
    lease_s = run.worker.settings.lease_s
    lost = run.worker.db(spread.lost_hosts, run.job, lease_s)
    if not lost:
        return False
    run.kill()  # no SIGTERM first: a checkpoint needs every rank, and the lost host's are gone
    run.fail(error_record(Failure.INFRASTRUCTURE, "HostLost", f"host {lost[0]} stopped heartbeating for "
                          f"{lease_s:g} s: its ranks of the job are lost"))
    return True


def read_events(run: JobRun, wait: float) -> None:
    """Handle the events the job process sent (waiting up to `wait` seconds for the first)."""
    events: list[dict] = []
    try:
        if run.out.wait(run.conn, wait):
            time.sleep(max(0.0, run.last_read + GATHER_S - time.monotonic()))
            run.last_read = time.monotonic()
        while len(events) < 1000 and run.conn.poll(0):
            events.append(run.conn.recv())
    except (EOFError, OSError):
        pass  # the job process is gone; supervise() notices through is_alive()
    # Progress (epochs, checkpoints) is written in one transaction per look at the pipe: a fast
    # job's hundred epochs a second must not become a hundred database commits a second.
    progress: list[dict] = []
    for event in events:
        if run.outcome is not None:
            break
        if event.get("type") in PROGRESS:
            progress.append(event)
            continue
        record_progress(run, progress)
        progress = []
        if run.outcome is None:
            handle(run, event)
    if run.outcome is None:
        record_progress(run, progress)


def record_progress(run: JobRun, events: list[dict]) -> None:
    """Epochs, checkpoints and the expected total, in one fenced write; older checkpoints are freed."""
    if not events:
        return
    epochs = [(e["epoch"], {k: v for k, v in e.items() if k not in ("type", "epoch")})
              for e in events if e["type"] == "epoch"]
    over = next(filter(None, (over_limit(epoch, data) for epoch, data in epochs)), None)
    if over:  # the job's own code sent it (trainyard.Context checks first): its records are not stored
        run.stop_now()
        run.fail(error_record(Failure.JOB, "MetricsOverLimit", over))
        return
    checkpoints = [e for e in events if e["type"] == "checkpoint"]
    totals = [e["epochs"] for e in events if e["type"] == "total"]
    latest = checkpoints[-1] if checkpoints else None
    layout = run.worker.settings.layout
    ckpt = (latest["epoch"], layout.rel(latest["path"])) if latest else None
    if not run.db(queue.record_progress, epochs, ckpt, totals[-1] if totals else None):
        run.lost()
        return
    if epochs:
        run.worker.note_torch_memory(epochs[-1][1])
    if latest:  # earlier checkpoints are no longer referenced: free their space
        for old in [run.checkpoint] + [c["path"] for c in checkpoints[:-1]]:
            if old and old != latest["path"]:
                forget(run, old)
        run.checkpoint = latest["path"]


def forget(run: JobRun, path: str) -> None:
    """Delete a checkpoint the database no longer points at; one left behind costs only space."""
    store = run.worker.settings.store
    try:
        store.delete(store.layout.rel(Path(path)))
    except Exception as exc:
        log.warning("job %s: could not delete old checkpoint %s: %s", run.job.id, path, exc)


def handle(run: JobRun, event: dict) -> None:
    """One event other than progress: a log line, a restart, the job's end (done, error, preempted)."""
    kind = event.get("type")
    if kind == "log":
        run.log(event["line"])
    elif kind == "restart":  # the checkpoint the database points at could not be read
        if run.db(queue.start_over):
            run.checkpoint = None
            run.log(f"checkpoint {event['path']} could not be read ({event['reason']}): starting over from "
                    "epoch 1; the metrics of earlier runs were dropped")
        else:
            run.outcome = Outcome.LOST
    elif kind == "done":  # the run dir holds a train job's model or a predict job's result.json
        run_dir = run.worker.settings.layout.rel(run.plan.run_dir)
        meta = run.plan.run_dir / ARTIFACT_FILES["meta"]
        if meta.is_file() and meta.stat().st_size > MAX_META_FILE_BYTES:  # written by the job's own code
            run.fail(error_record(Failure.JOB, "MetaOverLimit", f"the model's meta.json is "
                                  f"{meta.stat().st_size:,} bytes; the limit is {MAX_META_FILE_BYTES >> 20} MiB "
                                  "(save_model's extra meta: 64 KiB)"))
            return
        run.sum_up()
        run.outcome = Outcome.SUCCEEDED if run.db(queue.succeed, event["result"], run_dir) else Outcome.LOST
    elif kind == "error":
        run.log(event["error"].get("traceback") or "")
        run.fail(event["error"])
    elif kind == "preempted":
        run.log("checkpointed at a step boundary")
        run.stopped()
    if run.outcome == Outcome.LOST:
        run.lost()


def over_limit(epoch: object, data: dict) -> str | None:
    """Why an epoch record a job process sent breaks the bounds on what is stored of it, or None: whole-number
    epoch, at most MAX_METRIC_KEYS metrics (plus the built-in ones) of names up to MAX_METRIC_NAME characters,
    each a number or null."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 2**31:
        return f"report: epoch must be a whole number from 1, not {epoch!r}"
    if len(data) > MAX_METRIC_KEYS + BUILT_IN_METRIC_KEYS:
        return f"report: {len(data)} metrics is over the limit of {MAX_METRIC_KEYS} per report"
    for key, value in data.items():
        if not isinstance(key, str) or len(key) > MAX_METRIC_NAME:
            return f"report: metric name {str(key)[:40]!r}... is over the limit of {MAX_METRIC_NAME} characters"
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or isinstance(value, int) and abs(value) >= 2**63):
            return f"report: metric {key!r} must be a number, not {type(value).__name__}"
    return None
