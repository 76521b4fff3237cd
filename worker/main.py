"""The worker supervisor: register, claim, start a job process, heartbeat, cancel, finish, shut down.

One supervisor serves one device. It never imports torch and never initialises CUDA: jobs run in
child processes forked from a fork server that preloads torch (see worker/runner.py). Signal
handlers only set flags; the loop does the work.
"""
import logging
import multiprocessing as mp
import os
import re
import secrets
import shutil
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.exc import OperationalError

from app import devices as device_info
from app import queue
from app.db import create_all, make_engine
from app.settings import Settings
from app.spec import DEVICE_PATTERN
from worker import runner_entry

log = logging.getLogger("trainyard.worker")

# How often a running job's row is re-read: a cancel must stop the job process within 2 seconds.
FENCE_CHECK_S = 0.25
# Time a cancelled or timed-out job process gets to exit on SIGTERM before SIGKILL.
KILL_GRACE_S = 1.0


def _mp_context() -> mp.context.BaseContext:
    # A fork server with torch preloaded: a plain fork of a process that touched CUDA is unsafe,
    # and spawn would pay for `import torch` on every job.
    ctx = mp.get_context("forkserver")
    # app.cli too: each job process re-runs the supervisor's main module (`python -m app.cli`), which
    # is cheap only when its imports (httpx, rich, pydantic-settings) are already loaded.
    ctx.set_forkserver_preload(["worker.runner", "worker.warm", "app.cli"])
    return ctx


@dataclass
class Running:
    job: dict[str, Any]
    proc: Any
    conn: Any
    started: float
    outcome: str | None = None          # succeeded / failed / requeued / lost
    stop_reason: str | None = None      # why we are stopping the process, if we are
    stop_deadline: float | None = None
    log_path: Path | None = None
    extra: dict = field(default_factory=dict)


class Worker:
    def __init__(self, settings: Settings, device: str = "auto", burst: bool = False,
                 max_jobs: int | None = None):
        self.settings = settings
        self.device = resolve_device(device)
        self.burst = burst
        self.max_jobs = max_jobs
        self.engine = make_engine(settings.db_url)
        self.id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.stopping = False
        self.jobs_done = 0
        self.stats: dict[str, Any] = {}
        self._next_beat = 0.0

    def db(self, fn, *args, **kw):
        """Call a queue function, riding out a database that is briefly unreachable (a PostgreSQL
        restart, a failover) for up to one lease; SQLite's busy timeout already covers lock waits."""
        delay, deadline = 0.05, time.monotonic() + self.settings.lease_s
        while True:
            try:
                return fn(self.engine, *args, **kw)
            except OperationalError as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("database error, retrying in %.2fs: %s", delay, str(exc).splitlines()[0])
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    # -- lifecycle --------------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True

    def run(self) -> int:
        self.settings.ensure_dirs()
        create_all(self.engine)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.ctx = _mp_context()
        self.stats = {"build": self._warm_up(), "device_info": device_info.worker_device_info(self.device)}
        self.db(queue.register_worker, self.id, socket.gethostname(), os.getpid(), self.device, self.stats)
        log.info("worker %s on %s ready", self.id, self.device)
        idle_sleep = self.settings.poll_s
        try:
            while not self.stopping:
                try:
                    self._housekeeping(state="idle", job_id=None)
                    job = self.db(queue.claim, self.id, self.device, self.settings.lease_s) \
                        if self.db(queue.has_work, self.device) else None
                except OperationalError:
                    log.exception("database unavailable; the worker keeps trying")
                    time.sleep(2.0)
                    continue
                if job is None:
                    if self.burst:
                        break
                    time.sleep(idle_sleep)
                    continue
                self.run_job(job)
                self.jobs_done += 1
                if self.max_jobs is not None and self.jobs_done >= self.max_jobs:
                    break
        finally:
            self.db(queue.worker_heartbeat, self.id, "stopped", None)
            self.engine.dispose()
            log.info("worker %s stopped after %d jobs", self.id, self.jobs_done)
        return 0

    def _warm_up(self) -> dict:
        """Start the fork server now (it imports torch once, not on the first job) and ask a child
        what torch build the jobs will see."""
        parent, child = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=runner_entry.build_info, args=(child,))
        p.start()
        child.close()
        info = parent.recv() if parent.poll(300) else {}
        p.join()
        parent.close()
        return info

    def _housekeeping(self, state: str, job_id: int | None) -> None:
        now = time.monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + self.settings.heartbeat_s
        self.db(queue.worker_heartbeat, self.id, state, job_id, self.stats)
        for jid, new_state in queue.requeue_expired(self.engine):
            log.warning("job %s lost its worker (lease expired): now %s", jid, new_state)

    # -- one job ----------------------------------------------------------------------------------

    def _paths(self, job: dict) -> dict[str, Any]:
        data_dir = self.settings.data_dir
        artifact_rel = Path("artifacts") / str(job["id"]) / f"run-{job['claim']}"
        (data_dir / artifact_rel).mkdir(parents=True, exist_ok=True)
        ckpt_rel = Path("checkpoints") / str(job["id"]) / f"run-{job['claim']}.pt"
        (data_dir / ckpt_rel.parent).mkdir(parents=True, exist_ok=True)
        paths: dict[str, Any] = {
            "artifact_dir": str(data_dir / artifact_rel), "artifact_rel": str(artifact_rel),
            "checkpoint_path": str(data_dir / ckpt_rel),
            "resume_path": str(data_dir / job["checkpoint_path"]) if job.get("checkpoint_path") else None,
        }
        paths["checkpoint"] = paths["resume_path"]  # the checkpoint the database points at, to free once replaced
        paths["threads"] = self._cpu_threads() if self.device == "cpu" else None
        if job["kind"] == "predict":
            model_job = self.db(queue.get_job, job["spec"]["model_job"])
            paths["model_dir"] = str(data_dir / (model_job["artifact_path"] or "missing"))
            paths["model_spec"] = model_job["spec"]
        return paths

    def _cpu_threads(self) -> int:
        """torch threads for a CPU job: the host's cores shared among its live CPU workers.
        Two jobs each spinning two OpenMP threads on two cores run several times slower than
        two jobs with one thread each."""
        workers, now = self.db(queue.list_workers)
        here = [w for w in workers if w["host"] == socket.gethostname() and w["device"] == "cpu"
                and queue.worker_state(w, now, self.settings.lease_s) in ("idle", "busy")]
        return max(1, (os.cpu_count() or 1) // max(1, len(here)))

    def run_job(self, job: dict) -> None:
        log_dir = self.settings.data_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            paths = self._paths(job)
        except Exception as exc:  # e.g. the model job was deleted: the job's own problem
            self.db(queue.fail, job["id"], job["claim"],
                    {"class": queue.JOB_ERROR, "type": type(exc).__name__, "message": str(exc)})
            return
        parent_conn, child_conn = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=runner_entry.run, name=f"trainyard-job-{job['id']}",
                                args=(job, self.device, str(self.settings.data_dir), paths, child_conn))
        proc.start()
        child_conn.close()
        run = Running(job=job, proc=proc, conn=parent_conn, started=time.monotonic(),
                      log_path=log_dir / f"{job['id']}.log", extra=paths)
        threads = f", {paths['threads']} torch threads" if paths.get("threads") else ""
        self._log(run, f"attempt {job['attempt']} (run {job['claim']}) on {self.id} ({self.device}{threads}), "
                       f"job process pid {proc.pid}")
        try:
            self._supervise(run)
        except OperationalError:
            # We can no longer report for this job: stop it. Its lease runs out and the job is
            # requeued (from its last recorded checkpoint) for whichever worker reaches the database.
            log.exception("database unreachable while running job %s; stopping it", job["id"])
            self._stop_now(run)
        parent_conn.close()
        if run.outcome == "succeeded":
            shutil.rmtree(self.settings.data_dir / "checkpoints" / str(job["id"]), ignore_errors=True)

    def _supervise(self, run: Running) -> None:
        job_id, claim_no = run.job["id"], run.job["claim"]
        next_fence = next_renew = time.monotonic()
        timeout = run.job.get("timeout_s")
        while True:
            self._drain(run, wait=0.05)
            if run.outcome is not None:
                break
            now = time.monotonic()
            if not run.proc.is_alive():
                self._drain(run, wait=0)
                if run.outcome is None:
                    self._child_died(run)
                break
            if self.stopping and run.stop_reason is None:
                self._begin_stop(run, "shutdown", self.settings.grace_s)
            if timeout and now - run.started > timeout and run.stop_reason is None:
                self._begin_stop(run, "timeout", KILL_GRACE_S)
            if run.stop_deadline is not None and now > run.stop_deadline:
                self._kill(run)
            if now >= next_fence:
                next_fence = now + FENCE_CHECK_S
                if not self.db(queue.still_ours, job_id, claim_no):
                    self._lost(run)
                    break
            if now >= next_renew:
                next_renew = now + self.settings.heartbeat_s
                if not self.db(queue.renew, job_id, claim_no, self.settings.lease_s):
                    self._lost(run)
                    break
                self._housekeeping(state="busy", job_id=job_id)
        run.proc.join(timeout=5)

    def _begin_stop(self, run: Running, reason: str, grace: float) -> None:
        run.stop_reason = reason
        run.stop_deadline = time.monotonic() + grace
        self._log(run, f"stopping the job process ({reason})")
        if run.proc.is_alive():
            os.kill(run.proc.pid, signal.SIGTERM)

    def _kill(self, run: Running) -> None:
        if run.proc.is_alive():
            run.proc.kill()
        run.proc.join(timeout=5)

    def _stop_now(self, run: Running) -> None:
        if run.proc.is_alive():
            os.kill(run.proc.pid, signal.SIGTERM)
            run.proc.join(timeout=KILL_GRACE_S)
        self._kill(run)

    def _lost(self, run: Running) -> None:
        """The job was cancelled or taken over by another worker: stop our copy, write nothing."""
        self._stop_now(run)
        run.outcome = "lost"
        self._log(run, "job is no longer ours (cancelled or taken over): process stopped")

    def _child_died(self, run: Running) -> None:
        """The job process exited without reporting a result."""
        if run.stop_reason is not None:
            return self._stopped(run)
        code = run.proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        self._fail(run, {"class": queue.INFRASTRUCTURE, "type": "JobProcessDied",
                         "message": f"the job process {how} without reporting a result"})

    def _stopped(self, run: Running) -> None:
        """The job process was stopped (it checkpointed first if it could): why decides what follows.
        A SIGTERM we did not send (systemd, a container runtime signalling every process) is a shutdown."""
        if run.stop_reason in (None, "shutdown"):
            ok = self.db(queue.requeue_preempted, run.job["id"], run.job["claim"])
            run.outcome = "requeued" if ok else "lost"
            self._log(run, "requeued without using an attempt (worker shutting down)")
        else:
            self._fail(run, {"class": queue.TIMEOUT, "type": "Timeout",
                             "message": f"the job ran past its timeout_s of {run.job['timeout_s']} s and was stopped"})

    def _fail(self, run: Running, error: dict) -> None:
        self._log(run, f"{error['type']}: {error['message']}")
        run.outcome = self.db(queue.fail, run.job["id"], run.job["claim"], error) or "lost"

    def _drain(self, run: Running, wait: float) -> None:
        events = []
        try:
            while len(events) < 1000 and run.conn.poll(wait):
                wait = 0
                events.append(run.conn.recv())
        except (EOFError, OSError):
            pass  # the job process is gone; _supervise notices through is_alive()
        # Progress (epochs, checkpoints) is written in one transaction per look at the pipe: a fast
        # job's hundred epochs a second must not become a hundred database commits a second.
        progress: list[dict] = []
        for event in events:
            if run.outcome is not None:
                break
            if event.get("type") in ("epoch", "checkpoint"):
                progress.append(event)
                continue
            self._record_progress(run, progress)
            progress = []
            if run.outcome is None:
                self._handle(run, event)
        if run.outcome is None:
            self._record_progress(run, progress)

    def _record_progress(self, run: Running, events: list[dict]) -> None:
        if not events:
            return
        epochs = [(e["epoch"], {k: v for k, v in e.items() if k not in ("type", "epoch")})
                  for e in events if e["type"] == "epoch"]
        checkpoints = [e for e in events if e["type"] == "checkpoint"]
        latest = checkpoints[-1] if checkpoints else None
        ckpt = (latest["epoch"], os.path.relpath(latest["path"], self.settings.data_dir)) if latest else None
        if not self.db(queue.record_progress, run.job["id"], run.job["claim"], epochs, ckpt):
            self._lost(run)
            return
        mem = {k: v for k, v in (epochs[-1][1] if epochs else {}).items()
               if k in ("memory_allocated", "memory_reserved", "max_memory_allocated")}
        if mem:
            self.stats = {**self.stats, "torch": mem}
        if latest:  # earlier checkpoints are no longer referenced: free their disk
            for old in [run.extra.get("checkpoint")] + [c["path"] for c in checkpoints[:-1]]:
                if old and old != latest["path"]:
                    Path(old).unlink(missing_ok=True)
            run.extra["checkpoint"] = latest["path"]

    def _handle(self, run: Running, event: dict) -> None:
        job_id, claim_no = run.job["id"], run.job["claim"]
        kind = event.get("type")
        ok = True
        if kind == "log":
            self._log(run, event["line"])
        elif kind == "done":
            artifact = run.extra["artifact_rel"] if run.job["kind"] == "train" else None
            ok = self.db(queue.succeed, job_id, claim_no, event["result"], artifact)
            run.outcome = "succeeded"
        elif kind == "error":
            self._log(run, event["error"].get("traceback") or "")
            self._fail(run, event["error"])
            ok = run.outcome != "lost"
        elif kind == "preempted":
            self._log(run, "checkpointed at a step boundary")
            self._stopped(run)
            ok = run.outcome != "lost"
        if not ok:
            self._lost(run)

    def _log(self, run: Running, line: str) -> None:
        if run.log_path is not None:
            with open(run.log_path, "a", encoding="utf-8") as f:
                f.write(line.rstrip("\n") + "\n")


def resolve_device(device: str) -> str:
    """'auto' means the first CUDA device if the host has one, else the CPU (decided without CUDA init)."""
    if not re.fullmatch(DEVICE_PATTERN, device):
        raise SystemExit(f"trainyard worker: --device must be auto, cpu, cuda or cuda:N, not {device!r}")
    if device == "auto":
        return "cuda:0" if device_info.visible_cuda_count() > 0 else "cpu"
    if device == "cuda":
        return "cuda:0"
    return device


def main(settings: Settings, device: str, burst: bool = False, max_jobs: int | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return Worker(settings, device, burst=burst, max_jobs=max_jobs).run()
