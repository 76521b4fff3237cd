"""One job process under its supervisor: what has been decided about it so far, how it is stopped, and
how its end is recorded. Torch-free.

Every write goes through the queue fenced by the claim the job was taken with: when one changes nothing, the job
is no longer ours (cancelled, or taken over after our lease ran out) and our copy is stopped at once. The loop that
watches the process and turns its events into writes is supervise.py; the worker is reached only through WorkerLink.
"""
import logging
import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import InitVar, dataclass, field
from enum import StrEnum
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sqlalchemy.engine import Engine

from trainyard.app.core.settings import Settings
from trainyard.app.core.states import DEVICE_FAILURE, ErrorRecord, Failure, error_record
from trainyard.app.fleet import workers as registry
from trainyard.app.jobs import queue
from trainyard.app.records import Job, job_reads
from trainyard.worker import broken_links
from trainyard.worker.supervisor import gpu_release, memory, reaper
from trainyard.worker.supervisor.joblog import JobOutput
from trainyard.worker.supervisor.plan import JobPlan

log = logging.getLogger("trainyard.worker")
T = TypeVar("T")

KILL_GRACE_S = 1.0  # the time a cancelled or timed-out job process gets to exit on SIGTERM before SIGKILL


class WorkerLink(Protocol):
    """What the supervision of a job needs of its worker (worker/supervisor/main.py's Worker), and nothing more."""
    id: str
    settings: Settings
    engine: Engine
    stopping: bool  # the worker is shutting down
    network_call_since: float | None  # when the call to the database or bucket under way began (None: none)

    def on_the_network(self) -> AbstractContextManager[None]: ...

    def db(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T: ...

    def housekeeping(self, state: str, job_id: int | None) -> None: ...

    def mark_stopping(self, job_id: int | None) -> None: ...

    def mark_unavailable(self, reason: str) -> None: ...

    def note_torch_memory(self, metrics: dict) -> None: ...


class Outcome(StrEnum):
    """How a run ended for its supervisor (JobRun.outcome); the first three are the job's state it left."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    QUEUED = "queued"  # requeued: a shutdown, a preemption, a failure tried again
    LOST = "lost"      # no longer ours (cancelled, pruned, taken over): nothing more is written
    DONE = "done"      # a part leader's ranks ended (rank 0's worker records the job's end: part.py)


@dataclass
class JobRun:
    """One job process and what its supervisor has decided about it so far."""
    worker: WorkerLink
    plan: JobPlan
    proc: Any                           # the job process (a multiprocessing Process)
    conn: Connection                    # the read end of its events pipe
    log_path: Path
    output: InitVar[Connection | None] = None  # the read end of the job process's stdout/stderr pipe
    started: float = field(default_factory=time.monotonic)
    outcome: Outcome | None = None
    stop_reason: str | None = None      # why we are stopping the process: shutdown, preempt, timeout, memory
    stop_deadline: float | None = None
    checkpoint: str | None = None       # the latest recorded checkpoint: older ones are deleted
    watch: memory.Watch | None = None
    summed_up: bool = False             # the closing log lines are written
    last_read: float = 0.0              # when the pipe last had events
    publish: bool = True                # copy the log to a bucket store (not the log of another host's ranks)
    pids: set[int] = field(default_factory=set)  # the job's processes seen besides its own (a CUDA job's tree)
    ended_at: float | None = None       # when its supervisor saw the job process end

    def __post_init__(self, output: Connection | None) -> None:
        self.checkpoint = str(self.plan.resume_from) if self.plan.resume_from else None
        if self.plan.memory_budget:
            self.watch = memory.Watch(self.proc.pid, self.plan.memory_budget)
        self.out = JobOutput(self.log_path, self.worker.settings, self.job.id, output)
        # The job process's parent, the fork server: the orphans of a job process killed outright are its.
        self.fork_server = reaper.parent_of(self.proc.pid) or reaper.fork_server_pid()

    @property
    def job(self) -> Job:
        return self.plan.job

    def db(self, fn: Callable[..., T], *args: Any) -> T:
        """A fenced queue call for this job: fn(engine, job_id, claim, *args)."""
        return self.worker.db(fn, self.job.id, self.job.claim, *args)

    def log(self, line: str) -> None:
        self.out.line(line)

    def end_processes(self) -> None:
        """Once the job process is gone: end whatever it started that outlived it (adopted by the fork
        server: the job process was killed outright), copy the last of their output, and on a GPU wait for
        the driver to free the memory of them all before the worker claims again (worker/supervisor/gpu_release.py)."""
        if self.ended_at is None:
            self.ended_at = time.monotonic()
        on_gpu = gpu_release.job_gpus(self.plan)
        if on_gpu and self.fork_server is not None:
            self.pids.update(reaper.descendants(self.fork_server))  # the orphans of a job process killed outright
        if self.fork_server is not None and reaper.end_descendants(self.fork_server):
            log.warning("job %s: processes of the job outlived it (still ending)", self.job.id)
        self.out.close()
        if on_gpu and not self.worker.stopping:  # a stopping worker claims nothing more
            self.wait_for_gpu_memory(on_gpu)

    def wait_for_gpu_memory(self, gpus: list[str]) -> None:
        """Until NVML lists none of the job's processes on its GPUs (their CUDA contexts freed), heartbeating,
        at most TRAINYARD_GPU_RELEASE_WAIT_S; the job's log says how long it took."""
        limit = self.worker.settings.gpu_release_wait_s
        release = gpu_release.wait_for_release(
            {self.proc.pid, *self.pids}, lambda: gpu_release.read_nvml(gpus), limit,
            tick=self._beat_while_freeing) if limit > 0 else None
        if release is None:  # no NVML here (or no wait asked for): nothing known to wait for
            return
        after = time.monotonic() - (self.ended_at or time.monotonic())
        if release.freed:
            self.log(f"device memory freed {after:.1f} s after the job process ended")
        else:
            log.warning("job %s: NVML still lists its processes %.1f s after the job process ended (%s); the "
                        "worker claims again anyway (TRAINYARD_GPU_RELEASE_WAIT_S=%g)", self.job.id, after,
                        release.describe(), limit)
            self.log(f"device memory not freed {after:.1f} s after the job process ended: NVML still lists "
                     f"{release.describe()}")

    def _beat_while_freeing(self) -> None:
        """The worker's heartbeat while it waits (busy, with no job: it claims nothing meanwhile); a database
        away for the moment costs a beat, not the wait."""
        try:
            self.worker.housekeeping(state="busy", job_id=None)
        except Exception as exc:
            log.warning("job %s: heartbeat while its GPU memory is freed failed: %s", self.job.id, exc)

    def note_processes(self) -> None:
        """Remember the job process's tree before it is stopped (a CUDA job's: each may hold a CUDA context on
        its GPUs, which end_processes waits for to be freed after they are gone)."""
        if gpu_release.job_gpus(self.plan) and self.proc.is_alive():
            self.pids.update(reaper.descendants(self.proc.pid))

    def sum_up(self) -> None:
        """The job's closing log lines, written before its end is recorded: a client that sees the job
        ended reads its whole log."""
        self.out.flush()  # what it printed before it reported its end
        if self.watch is not None and not self.summed_up:
            self.log(f"job process peak memory: {memory.gib(self.watch.grown)} over its start "
                     f"(budget {memory.gib(self.watch.budget)})")
        self.summed_up = True
        self.publish_log()

    def publish_log(self, held: bool = False) -> None:
        """Copy the log to a bucket store, if this run is still the job's latest claim (held: known to be,
        by a renewal just now). The bucket keeps one log a job: a run taken over (a supervisor that was
        stopped past its lease, or cut off) would otherwise replace the next run's log with its own."""
        if self.publish:
            # On the network: a bucket gone with the host's link must not hide a lapsed lease from the LeaseWatch.
            with self.worker.on_the_network():
                self.out.publish(None if held else self._still_latest_claim)

    def _still_latest_claim(self) -> bool:
        try:
            if not self.worker.db(job_reads.claimed_since, self.job.id, self.job.claim):
                return True
            log.info("job %s: claimed again since claim %s; its log stays on this host", self.job.id, self.job.claim)
        except Exception as exc:  # the database away: publish nothing that could be stale
            log.warning("job %s: log not published (the claim could not be checked: %s)", self.job.id, exc)
        return False

    # -- stopping ---------------------------------------------------------------------------------

    def check_stops(self, now: float, timeout: bool = True) -> None:
        """Begin a stop the worker's shutdown or the job's timeout asks for; SIGKILL once its grace is up.
        timeout False: another worker holds the job to its timeout (rank 0's, for a job across hosts)."""
        if self.worker.stopping and self.stop_reason is None:
            self.worker.mark_stopping(self.job.id)
            self.begin_stop("shutdown", self.worker.settings.grace_s)
        limit = self.job.timeout_s if timeout else None
        if limit and now - self.started > limit and self.stop_reason is None:
            self.begin_stop("timeout", KILL_GRACE_S)
        if self.stop_deadline is not None and now > self.stop_deadline:
            self.kill()

    def check_memory(self) -> None:
        """SIGKILL the job process once it has grown past its host-memory budget (child_died then fails it oom)."""
        if self.watch is not None and self.watch.over() and self.stop_reason != "memory":
            self.begin_stop("memory", 0)

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
            self.note_processes()
            self.proc.kill()
        self.proc.join(timeout=5)
        if self.ended_at is None and not self.proc.is_alive():
            self.ended_at = time.monotonic()

    def stop_now(self) -> None:
        if self.proc.is_alive():
            self.note_processes()
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.join(timeout=KILL_GRACE_S)
        self.kill()

    def lost(self, why: str | None = None) -> None:
        """The job was ended (cancelled, pruned by its sweep) or taken over by another worker, or its lease
        ran out: stop our copy, write nothing (every write is fenced). The log says which (why, or the row's)."""
        self.stop_now()
        self.outcome = Outcome.LOST
        if why is None:
            try:  # one try, not the lease-long retries of self.db: the log's last line must not wait on it
                with self.worker.on_the_network():
                    why = job_reads.why_lost(self.worker.engine, self.job.id, self.job.claim)
            except Exception as exc:  # the database away: the log says what is known
                log.warning("job %s: why it is no longer ours could not be read: %s", self.job.id, exc)
                why = "cancelled, pruned or taken over"
        self.log(f"job is no longer ours ({why}): process stopped")
        self.sum_up()

    # -- endings ----------------------------------------------------------------------------------

    def child_died(self) -> None:
        """The job process exited without reporting a result: stopped by us, or died on its own while
        its worker lives (then it is the job's failure, never retried as if the host had failed)."""
        if self.stop_reason == "memory" and self.watch is not None:
            return self.fail(error_record(Failure.OOM, "MemoryBudgetExceeded", memory.budget_message(
                self.watch.budget, self.watch.grown, "; the worker stopped it")))
        if self.stop_reason is not None:
            return self.stopped()
        code = self.proc.exitcode
        if code == -signal.SIGKILL:
            seen = f"; it used {memory.gib(self.watch.grown)} (budget {memory.gib(self.watch.budget)})" \
                if self.watch else ""
            return self.fail(error_record(Failure.OOM, "KilledByKernel", "the job process was killed (SIGKILL) "
                                          f"without its worker asking, most likely out of host memory{seen}"))
        watchdog = code == -signal.SIGABRT and len(self.plan.ranks) > 1
        if watchdog and broken_links.aborted_by_watchdog(self.out.tail()):
            return self.fail(error_record(Failure.INFRASTRUCTURE, "RankLost", "the job process (rank 0) was aborted by "
                                          "NCCL's watchdog: a rank or its link went away (its log says which)"))
        how = f"died of signal {signal.Signals(-code).name}" if code is not None and code < 0 \
            else f"exited with code {code}"
        self.fail(error_record(Failure.CRASHED, "JobProcessDied", f"the job process {how} without reporting a result"))

    def stopped(self) -> None:
        """The job process was stopped (it checkpointed first if it could): why decides what follows (a shutdown
        or a preemption requeues it, a timeout fails it). A SIGTERM we did not send (systemd, a container runtime
        signalling every process) is a shutdown."""
        if self.stop_reason in (None, "shutdown", "preempt"):
            if self.worker.stopping:
                self.worker.mark_stopping(self.job.id)
            self.sum_up()
            self.outcome = Outcome.QUEUED if self.db(queue.requeue_preempted) else Outcome.LOST
            why = "preempted for a job of higher priority" if self.stop_reason == "preempt" else "worker shutting down"
            self.log(f"requeued without using an attempt ({why})")
        else:
            self.fail(error_record(Failure.TIMEOUT, "Timeout",
                                   f"the job ran past its timeout_s of {self.job.timeout_s} s and was stopped"))

    def fail(self, error: ErrorRecord) -> None:
        self.log(f"{error['type']}: {error['message']}")
        if error.get("type") == DEVICE_FAILURE:
            self.out_of_service(error)
        self.sum_up()
        self.outcome = Outcome(new) if (new := self.db(queue.fail, error)) else Outcome.LOST  # failed, or queued again

    def out_of_service(self, error: ErrorRecord) -> None:
        """The worker whose device failed takes no more jobs: this one (its own device: rank 0, or the first of
        this host's ranks), or the one that lent the failed rank its device (registry.quarantine)."""
        why = f"{error['message']} (under job {self.job.id}); restart the worker once the device works again"
        owner = registry.device_owner(self.job.ranks, error.get("rank"))
        if owner is None or owner == self.worker.id:
            self.worker.mark_unavailable(why)
        elif self.worker.db(registry.quarantine, owner, why):
            self.log(f"worker {owner}, whose device rank {error['rank']} used, is out of service")
        else:
            log.warning("job %s: worker %s, whose device failed, is no longer live to take out of service",
                        self.job.id, owner)
