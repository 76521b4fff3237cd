"""One job process under its supervisor: renew the lease, check the fence, watch its memory, stop it
on shutdown, cancel or timeout, and turn its events into fenced writes. Torch-free.

Every write goes through the queue fenced by the claim the job was taken with: when one changes
nothing, the job is no longer ours (cancelled, or taken over after our lease ran out) and our copy
is stopped at once.
"""
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing import connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.app import queue
from trainyard.app.layout import ARTIFACT_FILES
from trainyard.app.spec import MAX_META_FILE_BYTES, MAX_METRIC_KEYS, MAX_METRIC_NAME
from trainyard.app.states import DEVICE_FAILURE, Failure, error_record
from trainyard.worker import memory, reaper
from trainyard.worker.joblog import CappedLog
from trainyard.worker.plan import JobPlan

if TYPE_CHECKING:
    from trainyard.worker.main import Worker

log = logging.getLogger("trainyard.worker")

# How often a running job's row is re-read: a cancel must stop the job process within 2 seconds.
FENCE_CHECK_S = 0.25
# Time a cancelled or timed-out job process gets to exit on SIGTERM before SIGKILL.
KILL_GRACE_S = 1.0
PROGRESS = ("epoch", "checkpoint", "total")
# While a job's events flow, its pipe is read at most this often: a job finishing a thousand epochs
# a second costs twenty commits a second, not a thousand, and leaves the other cores to training.
GATHER_S = 0.05
# Keys an epoch record may hold besides a report's own: the built-in trainer's and the allocator's.
BUILT_IN_METRIC_KEYS = 24
# The job's output is copied to its log at most this much per look at its pipe (the pipe holds 1 MiB).
PUMP_BYTES = 4 << 20


@dataclass
class JobRun:
    """One job process and what its supervisor has decided about it so far."""
    worker: "Worker"
    plan: JobPlan
    proc: Any
    conn: Any
    log_path: Path
    output: Any = None                  # the read end of the job process's stdout/stderr pipe
    started: float = field(default_factory=time.monotonic)
    outcome: str | None = None          # succeeded / failed / queued / lost
    stop_reason: str | None = None      # why we are stopping the process: shutdown, timeout, memory
    stop_deadline: float | None = None
    checkpoint: str | None = None       # the latest recorded checkpoint: older ones are deleted
    watch: memory.Watch | None = None
    summed_up: bool = False             # the closing log lines are written
    published: tuple | None = None      # (size, mtime) of the log when last published to the store
    last_read: float = 0.0              # when the pipe last had events

    def __post_init__(self) -> None:
        self.checkpoint = str(self.plan.resume_from) if self.plan.resume_from else None
        if self.plan.memory_budget:
            self.watch = memory.Watch(self.proc.pid, self.plan.memory_budget)
        self.out = CappedLog(self.log_path, self.worker.settings.job_log_bytes)
        # The job process's parent, the fork server: the orphans of a job process killed outright are its.
        self.fork_server = reaper.parent_of(self.proc.pid) or reaper.fork_server_pid()

    @property
    def job(self):
        return self.plan.job

    def db(self, fn, *args):
        """A fenced queue call for this job: fn(engine, job_id, claim, *args)."""
        return self.worker.db(fn, self.job.id, self.job.claim, *args)

    def log(self, line: str) -> None:
        self.out.line(line)

    def pump(self, limit: int = PUMP_BYTES) -> None:
        """Copy what the job (and every process it started) printed to its log, up to limit bytes."""
        while limit > 0 and self.output is not None:
            try:
                data = os.read(self.output.fileno(), min(1 << 20, limit))
            except BlockingIOError:
                return
            if not data:  # every writer is gone
                self.out.finish_pending()
                self.output.close()
                self.output = None
                return
            self.out.output(data)
            limit -= len(data)

    def wait_events(self, wait: float) -> bool:
        """Up to `wait` seconds for the job's next event, copying its output meanwhile: True if one waits."""
        deadline = time.monotonic() + wait
        while self.output is not None:
            ready = connection.wait([self.conn, self.output], max(0.0, deadline - time.monotonic()))
            if self.output in ready:
                self.pump()
            if self.conn in ready or time.monotonic() >= deadline:
                break
        return self.conn.poll(max(0.0, deadline - time.monotonic()))

    def end_processes(self) -> None:
        """Once the job process is gone: end whatever it started that outlived it (adopted by the fork
        server: the job process was killed outright), then copy the last of their output."""
        if self.fork_server is not None and reaper.end_descendants(self.fork_server):
            log.warning("job %s: processes of the job outlived it (still ending)", self.job.id)
        self.pump()
        if self.output is not None:
            self.output.close()
            self.output = None
        self.out.finish_pending()

    def sum_up(self) -> None:
        """The job's closing log lines, written before its end is recorded: a client that sees the job
        ended reads its whole log."""
        self.pump()  # what it printed before it reported its end
        self.out.finish_pending()
        if self.watch is not None and not self.summed_up:
            self.log(f"job process peak memory: {memory.gib(self.watch.grown)} over its start "
                     f"(budget {memory.gib(self.plan.memory_budget)})")
        self.summed_up = True
        self.publish_log()

    def publish_log(self) -> None:
        """Copy the log to a bucket store when it changed (every heartbeat, and before the job's end is
        recorded), so that the API on any host serves it. A failed upload costs a stale log, not the job."""
        store = self.worker.settings.store
        if not store.remote:
            return
        try:
            stat = self.log_path.stat()
            if (stat.st_size, stat.st_mtime_ns) != self.published:
                store.publish(self.log_path)
                self.published = (stat.st_size, stat.st_mtime_ns)
        except Exception as exc:
            log.warning("job %s: log not published to %s: %s", self.job.id, store.describe(), exc)

    # -- the loop ---------------------------------------------------------------------------------

    def supervise(self) -> None:
        next_fence = next_renew = time.monotonic()
        settings = self.worker.settings
        while True:
            self.drain(wait=0.05)
            if self.outcome is not None:
                break
            if not self.proc.is_alive():
                self.drain(wait=0)
                if self.outcome is None:
                    self.child_died()
                break
            now = time.monotonic()
            self.check_stops(now)
            if now >= next_fence:
                next_fence = now + FENCE_CHECK_S
                if self.watch is not None and self.watch.over() and self.stop_reason != "memory":
                    self.begin_stop("memory", 0)
                if not self.db(queue.still_ours):
                    self.lost()
                    break
            if now >= next_renew:
                next_renew = now + settings.heartbeat_s
                if not self.db(queue.renew, settings.lease_s):
                    self.lost()
                    break
                self.worker.housekeeping(state="busy", job_id=self.job.id)
                self.publish_log()
        self.proc.join(timeout=5)

    def check_stops(self, now: float) -> None:
        if self.worker.stopping and self.stop_reason is None:
            self.worker.mark_stopping(self.job.id)
            self.begin_stop("shutdown", self.worker.settings.grace_s)
        timeout = self.job.timeout_s
        if timeout and now - self.started > timeout and self.stop_reason is None:
            self.begin_stop("timeout", KILL_GRACE_S)
        if self.stop_deadline is not None and now > self.stop_deadline:
            self.kill()

    # -- stopping ---------------------------------------------------------------------------------

    def begin_stop(self, reason: str, grace: float) -> None:
        """SIGTERM now (the job checkpoints at its next step), SIGKILL after grace; memory: SIGKILL now."""
        self.stop_reason = reason
        self.stop_deadline = time.monotonic() + grace
        self.log(f"stopping the job process ({reason})")
        if reason == "memory":
            self.kill()
        elif self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)

    def stop_now(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.join(timeout=KILL_GRACE_S)
        self.kill()

    def lost(self) -> None:
        """The job was cancelled or taken over by another worker: stop our copy, write nothing."""
        self.stop_now()
        self.outcome = "lost"
        self.log("job is no longer ours (cancelled or taken over): process stopped")
        self.sum_up()

    # -- endings ----------------------------------------------------------------------------------

    def child_died(self) -> None:
        """The job process exited without reporting a result: stopped by us, or died on its own while
        its worker lives (then it is the job's failure, never retried as if the host had failed)."""
        if self.stop_reason == "memory":
            return self.fail(error_record(Failure.OOM, "MemoryBudgetExceeded", memory.budget_message(
                self.plan.memory_budget, self.watch.grown, "; the worker stopped it")))
        if self.stop_reason is not None:
            return self.stopped()
        code = self.proc.exitcode
        if code == -signal.SIGKILL:
            seen = f"; it used {memory.gib(self.watch.grown)} (budget {memory.gib(self.plan.memory_budget)})" \
                if self.watch else ""
            return self.fail(error_record(Failure.OOM, "KilledByKernel", "the job process was killed (SIGKILL) "
                                          f"without its worker asking, most likely out of host memory{seen}"))
        how = f"died of signal {signal.Signals(-code).name}" if code is not None and code < 0 \
            else f"exited with code {code}"
        self.fail(error_record(Failure.CRASHED, "JobProcessDied", f"the job process {how} without reporting a result"))

    def stopped(self) -> None:
        """The job process was stopped (it checkpointed first if it could): why decides what follows.
        A SIGTERM we did not send (systemd, a container runtime signalling every process) is a shutdown."""
        if self.stop_reason in (None, "shutdown"):
            if self.worker.stopping:
                self.worker.mark_stopping(self.job.id)
            self.sum_up()
            self.outcome = "queued" if self.db(queue.requeue_preempted) else "lost"
            self.log("requeued without using an attempt (worker shutting down)")
        else:
            self.fail(error_record(Failure.TIMEOUT, "Timeout",
                                   f"the job ran past its timeout_s of {self.job.timeout_s} s and was stopped"))

    def fail(self, error: dict) -> None:
        self.log(f"{error['type']}: {error['message']}")
        if error.get("type") == DEVICE_FAILURE and not error.get("rank"):  # its own device, not a lent one
            self.worker.mark_unavailable(f"{error['message']} (under job {self.job.id}); restart the worker "
                                         "once the device works again")
        self.sum_up()
        self.outcome = self.db(queue.fail, error) or "lost"

    # -- events -----------------------------------------------------------------------------------

    def drain(self, wait: float) -> None:
        events = []
        try:
            if self.wait_events(wait):
                time.sleep(max(0.0, self.last_read + GATHER_S - time.monotonic()))
                self.last_read = time.monotonic()
            while len(events) < 1000 and self.conn.poll(0):
                events.append(self.conn.recv())
        except (EOFError, OSError):
            pass  # the job process is gone; supervise() notices through is_alive()
        # Progress (epochs, checkpoints) is written in one transaction per look at the pipe: a fast
        # job's hundred epochs a second must not become a hundred database commits a second.
        progress: list[dict] = []
        for event in events:
            if self.outcome is not None:
                break
            if event.get("type") in PROGRESS:
                progress.append(event)
                continue
            self.record_progress(progress)
            progress = []
            if self.outcome is None:
                self.handle(event)
        if self.outcome is None:
            self.record_progress(progress)

    def record_progress(self, events: list[dict]) -> None:
        if not events:
            return
        epochs = [(e["epoch"], {k: v for k, v in e.items() if k not in ("type", "epoch")})
                  for e in events if e["type"] == "epoch"]
        over = next(filter(None, (over_limit(epoch, data) for epoch, data in epochs)), None)
        if over:  # the job's own code sent it (trainyard.Context checks first): its records are not stored
            self.stop_now()
            self.fail(error_record(Failure.JOB, "MetricsOverLimit", over))
            return
        checkpoints = [e for e in events if e["type"] == "checkpoint"]
        totals = [e["epochs"] for e in events if e["type"] == "total"]
        latest = checkpoints[-1] if checkpoints else None
        layout = self.worker.settings.layout
        ckpt = (latest["epoch"], layout.rel(latest["path"])) if latest else None
        if not self.db(queue.record_progress, epochs, ckpt, totals[-1] if totals else None):
            self.lost()
            return
        if epochs:
            self.worker.note_torch_memory(epochs[-1][1])
        if latest:  # earlier checkpoints are no longer referenced: free their space
            for old in [self.checkpoint] + [c["path"] for c in checkpoints[:-1]]:
                if old and old != latest["path"]:
                    self.forget(old)
            self.checkpoint = latest["path"]

    def forget(self, path: str) -> None:
        store = self.worker.settings.store
        try:
            store.delete(store.layout.rel(path))
        except Exception as exc:
            log.warning("job %s: could not delete old checkpoint %s: %s", self.job.id, path, exc)

    def handle(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "log":
            self.log(event["line"])
        elif kind == "restart":  # the checkpoint the database points at could not be read
            if self.db(queue.start_over):
                self.checkpoint = None
                self.log(f"checkpoint {event['path']} could not be read ({event['reason']}): starting over from "
                         "epoch 1; the metrics of earlier runs were dropped")
            else:
                self.outcome = "lost"
        elif kind == "done":  # the run dir holds a train job's model or a predict job's result.json
            run_dir = self.worker.settings.layout.rel(self.plan.run_dir)
            meta = self.plan.run_dir / ARTIFACT_FILES["meta"]
            if meta.is_file() and meta.stat().st_size > MAX_META_FILE_BYTES:  # written by the job's own code
                self.fail(error_record(Failure.JOB, "MetaOverLimit", f"the model's meta.json is "
                                       f"{meta.stat().st_size:,} bytes; the limit is {MAX_META_FILE_BYTES >> 20} MiB "
                                       "(save_model's extra meta: 64 KiB)"))
                return
            self.sum_up()
            self.outcome = "succeeded" if self.db(queue.succeed, event["result"], run_dir) else "lost"
        elif kind == "error":
            self.log(event["error"].get("traceback") or "")
            self.fail(event["error"])
        elif kind == "preempted":
            self.log("checkpointed at a step boundary")
            self.stopped()
        if self.outcome == "lost":
            self.lost()


def over_limit(epoch, data: dict) -> str | None:
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
