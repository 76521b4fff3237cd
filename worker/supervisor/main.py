"""The worker: register, claim one job at a time and run it, heartbeat, shut down.

One worker serves one device. It never imports torch and never initialises CUDA: jobs run in child
processes forked from a fork server that preloads torch (worker/fork_server.py, worker/runner.py).
A claimed job is planned by worker/supervisor/prepare.py and run by worker/supervisor/launch.py, which supervises it
(worker/supervisor/supervise.py) through the narrow view of this Worker that worker/supervisor/job_run.py names.
Signal handlers only set flags; the loop does the work.
"""
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from multiprocessing.context import ForkServerContext
from types import FrameType
from typing import Any, TypeVar

from sqlalchemy.exc import OperationalError

from trainyard.app.core import device_names, plugins, ports
from trainyard.app.core.settings import Settings
from trainyard.app.db import make_engine, migrate, wakeup
from trainyard.app.duties import dependents
from trainyard.app.fleet import gpu_order, hardware, idle_look, placement, spread
from trainyard.app.fleet import workers as registry
from trainyard.app.jobs import queue
from trainyard.app.records import Job
from trainyard.worker import fork_server
from trainyard.worker.supervisor import launch, part, prepare, slots, status_file
from trainyard.worker.supervisor.plan import JobPlan

log = logging.getLogger("trainyard.worker")
T = TypeVar("T")
# The least time between two looks at the queue of an idle worker (see run()); the first look after a
# quiet spell is immediate.
LOOK_GAP_S = 0.02


class Worker:
    """One worker process: its device, its registration and heartbeat, its loop over the queue."""
    ctx: ForkServerContext  # the fork server its jobs are forked from (run() starts it)

    def __init__(self, settings: Settings, device: str = "auto", burst: bool = False,
                 max_jobs: int | None = None, for_job: int | None = None):
        self.settings = settings
        self.device = device_names.for_worker(device, gpu_order.visible_cuda_count() if device == "auto" else 0)
        self.burst = burst
        self.max_jobs = max_jobs
        self.for_job = for_job  # an allocation's worker (app/clusters/): it serves this job alone, until it ends
        self.engine = make_engine(settings.db_url)
        self.id = f"{settings.node}-{os.getpid()}-{secrets.token_hex(3)}"
        self.stopping = False
        self.jobs_done = 0
        self.plugins: dict[str, list[str]] = {}
        self.slot = placement.Slot(self.id)  # run() finds the device's own
        self.stats: dict[str, Any] = {}
        self.unavailable: str | None = None  # why this worker cannot use its device: it then claims nothing
        self.torch_uuids: list[str | None] | None = None  # torch's CUDA devices in its order (the warm-up reads them)
        self._next_beat = 0.0
        self._beat_for: tuple[str, int | None] | None = None  # the (state, job) the last heartbeat was asked for
        self._marked_stopping = False
        self._last_look = 0.0
        # What its looks at the queue remember (app/fleet/idle_look.py), and whether a wake-up came since the last one.
        self.look = idle_look.Look(every_s=settings.lease_s)
        self._woken = True
        self.listener: wakeup.Listener | None = None  # run() starts listening for queue changes
        self.network_call_since: float | None = None  # when the call to the database or bucket under way began
        self.last_part: tuple[int, int] | None = None  # the (job, claim) whose ranks on this host it ran last

    def db(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Call a queue function, riding out a database that is briefly unreachable (a PostgreSQL
        restart, a failover) for up to one lease; SQLite's busy timeout already covers lock waits."""
        delay, deadline = 0.05, time.monotonic() + self.settings.lease_s
        with self.on_the_network():
            while True:
                try:
                    return fn(self.engine, *args, **kw)
                except OperationalError as exc:
                    if time.monotonic() > deadline:
                        raise
                    log.warning("database error, retrying in %.2fs: %s", delay, str(exc).splitlines()[0])
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)

    @contextmanager
    def on_the_network(self) -> Iterator[None]:
        """Marks a call to the database or the bucket under way, which a running job's LeaseWatch reads
        (worker/supervisor/supervise.py): a supervisor stuck in one past its lease was cut off. A call made within
        another
        (a claim check inside a log upload) keeps the outer one's start."""
        outer = self.network_call_since
        if outer is None:
            self.network_call_since = time.monotonic()
        try:
            yield
        finally:
            self.network_call_since = outer

    # -- lifecycle --------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        if self.listener is not None:
            self.listener.interrupt()

    def run(self) -> int:
        self.settings.ensure_dirs()
        migrate.prepare(self.engine)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        fork_server.pci_bus_order()
        self.ctx = fork_server.mp_context()
        offered = plugins.offered(self.settings.plugins)
        self.plugins = plugins.names(offered)  # what a job may need of this worker (the claim reads it)
        build = fork_server.warm_up(self.ctx)
        # torch's devices by UUID (without CUDA: None, and CUDA_VISIBLE_DEVICES numbers NVML's GPUs)
        self.torch_uuids = [d.get("uuid") for d in build.get("cuda_devices") or []] \
            if build.get("cuda_available") else None
        reading = hardware.host_reading(self.device, self.torch_uuids)
        # Checked here, from what the warm-up child saw (the supervisor never touches CUDA): a worker that
        # cannot use its device registers as unavailable, with why, rather than fail every job it claims.
        self.unavailable = hardware.device_problem(self.device, build, reading, os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.slot = replace(self._slot(reading, build), for_job=self.for_job,
                            allocation=os.environ.get("SLURM_JOB_ID") if self.for_job else None)
        self.stats = {"build": build, "host": reading, "slot": asdict(self.slot), "unavailable": self.unavailable,
                      "plugins": self.plugins, "plugin_details": plugins.describe(offered),
                      "addr": self.settings.node_addr}
        status_file.write(self.settings, registry.UNAVAILABLE if self.unavailable else "idle", self.unavailable)
        self.db(registry.register_worker, self.id, self.settings.node, os.getpid(), self.device, self.stats,
                registry.UNAVAILABLE if self.unavailable else "idle")
        self.listener = wakeup.Listener(self.engine, self.id)
        if self.unavailable:
            log.error("worker %s is unavailable, it takes no job: %s", self.id, self.unavailable)
        else:
            log.info("worker %s on %s ready (files: %s)", self.id, self.device, self.settings.store.describe())
        try:
            while not self.stopping and not self._done():
                job = self._next_job()
                if job is None:
                    if self.burst:
                        # What waits on a job that will never succeed is failed now, as a server would: a burst
                        # with no server must not leave such a chain queued for ever.
                        self.db(dependents.fail_dependents)
                        break
                    # Woken when the queue changes; poll_s is only the safety net. Heartbeats stay on time.
                    self._woken = self.listener.wait(
                        max(0.0, min(self.settings.poll_s, self._next_beat - time.monotonic())))
                    # A burst of submissions this worker cannot take (another device's, say) wakes it once
                    # per look, not once per job: looks are at least LOOK_GAP_S apart.
                    time.sleep(max(0.0, self._last_look + LOOK_GAP_S - time.monotonic()))
                    continue
                if self._leads_part(job):
                    part.run_part(self, job)
                    continue
                self.run_job(job)
                self.jobs_done += 1
        finally:
            if self.listener is not None:
                self.listener.close()
            self.db(registry.worker_heartbeat, self.id, "stopped", None)
            self.engine.dispose()
            log.info("worker %s stopped after %d jobs", self.id, self.jobs_done)
        return 1 if self.unavailable and self.burst else 0

    def _done(self) -> bool:
        return (self.max_jobs is not None and self.jobs_done >= self.max_jobs) or (
            self.for_job is not None and self.db(placement.ended, self.for_job, self.slot.allocation))

    def _next_job(self) -> Job | None:
        self._last_look = time.monotonic()
        try:
            self.housekeeping(state="idle", job_id=None)
            if self.unavailable:
                return None
            self.slot = slots.with_free(self.slot, self.device)
            if self.slot.addr:  # lent to a job across hosts, the first of this host's ranks: run them
                job = self.db(spread.part_to_run, self.id, self.settings.node)
                if job is not None and (job.id, job.claim) != self.last_part:
                    self.last_part = (job.id, job.claim)
                    return job
            # A safety-net look (not woken) costs one statement when nothing changed since the last one.
            woken, self._woken = self._woken, False
            if self.db(queue.has_work, self.device, self.plugins, self.id, self.slot, self.settings.lease_s,
                       look=self.look, woken=woken):
                return self.db(queue.claim, self.id, self.device, self.settings.lease_s, self.plugins, self.slot,
                               port=ports.free_port(self.slot.addr) if self.slot.addr else 0, look=self.look)
        except OperationalError:
            log.exception("database unavailable; the worker keeps trying")
            time.sleep(2.0)
        return None

    def _leads_part(self, job: Job) -> bool:
        return spread.part_leaders(job.ranks).get(self.settings.node) == self.id

    def _slot(self, reading: dict, build: dict | None = None) -> placement.Slot:
        return slots.of(self.settings, self.id, self.device, reading, build)

    def housekeeping(self, state: str, job_id: int | None) -> None:
        """Heartbeat and sweep for lost jobs, at most every heartbeat_s (a job begun: at once). The API server
        sweeps too: any live process recovers a job whose worker vanished (see app.api.background.reap)."""
        now = time.monotonic()
        # A job just begun is shown at once (/workers names it without a heartbeat's delay); the rest, and the
        # sweep, at most every heartbeat_s: a worker running many short jobs must not write twice per job.
        due = now >= self._next_beat
        if not due and (job_id is None or (state, job_id) == self._beat_for):
            return
        self._beat_for = (state, job_id)
        if due:
            self._next_beat = now + self.settings.heartbeat_s
        # This host's GPUs as NVML sees them now (memory used by every process on them): /devices and
        # the placement of jobs read the freshest heartbeat.
        here = self._live_workers_here()
        self.slot = replace(self.slot, gang=len([w for w in here["all"] if not w.get("draining")
                                                 and (w["device"] == "cpu") == (self.device == "cpu")]) or 1)
        self.stats = {**self.stats, "host": hardware.host_reading(self.device, self.torch_uuids),
                      "slot": asdict(self.slot), "unavailable": self.unavailable}
        if self._marked_stopping:
            state = "stopping"
        elif self.unavailable and state == "idle":
            state = registry.UNAVAILABLE
        elif state == "idle":  # lent to another worker's multi-device job: its device is one of that job's ranks
            lent = self.db(registry.lent_to, self.id)
            state, job_id = ("busy", lent) if lent is not None else (state, job_id)
        status_file.write(self.settings, state, self.unavailable)  # the container's health check reads it
        if (held := self.db(registry.worker_heartbeat, self.id, state, job_id, self.stats)) and not self.unavailable:
            self.mark_unavailable(held)  # another worker took it out of service: the device it lent failed
        for jid, new_state in self.db(queue.requeue_expired) if due else ():
            log.warning("job %s lost its worker (lease expired): now %s", jid, new_state)

    def mark_stopping(self, job_id: int | None) -> None:
        """Shown before the job is requeued: no other worker may count this one's device as free to borrow
        while it leaves (placement.helpers takes idle or busy workers only)."""
        if not self._marked_stopping:
            self._marked_stopping = True
            self.db(registry.worker_heartbeat, self.id, "stopping", job_id)

    def mark_unavailable(self, reason: str) -> None:
        """The device failed under a job: claim nothing more (the job is retried on another worker), and
        say why at once (/workers, /devices, the waiting_for of the jobs only this worker could take)."""
        log.error("worker %s is now unavailable, it takes no more jobs: %s", self.id, reason)
        self.unavailable = reason
        self.stats = {**self.stats, "unavailable": reason}
        status_file.write(self.settings, registry.UNAVAILABLE, reason)
        self.db(registry.worker_heartbeat, self.id, registry.UNAVAILABLE, None, self.stats)

    def note_torch_memory(self, metrics: dict) -> None:
        """Keep a job's latest allocator stats for the next heartbeat (/devices shows them)."""
        mem = {k: v for k, v in metrics.items() if k in ("memory_allocated", "memory_reserved", "max_memory_allocated")}
        if mem:
            self.stats = {**self.stats, "torch": mem}

    # -- one job ----------------------------------------------------------------------------------

    def plan(self, job: Job) -> JobPlan:
        """The claimed job's plan on this host (worker/supervisor/prepare.py): what its process is told."""
        return prepare.plan_job(job, self.settings, self.device, self.db, self._live_workers_here(),
                                prepare.gpu_fraction(job, self.settings, self.device, self.slot, self.stats))

    def run_job(self, job: Job) -> None:
        """Run the claimed job in a process of its own until its end is recorded (worker/supervisor/launch.py)."""
        launch.run_job(self, job)

    def _live_workers_here(self) -> dict[str, list]:
        """This host's live workers, all and CPU ones. CPU jobs share the cores among the CPU workers
        (two jobs each spinning two OpenMP threads on two cores run several times slower than two
        jobs with one thread each); every job shares the host's memory."""
        workers, now = self.db(registry.list_workers)
        here = [w for w in workers if w["host"] == self.settings.node
                and registry.worker_state(w, now, self.settings.lease_s) in registry.LIVE]
        return {"all": here, "cpu": [w for w in here if w["device"] == "cpu"]}


def main(settings: Settings, device: str, burst: bool = False, max_jobs: int | None = None,
         for_job: int | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        worker = Worker(settings, device, burst=burst, max_jobs=max_jobs, for_job=for_job)
    except ValueError as exc:
        raise SystemExit(f"trainyard worker: --device {exc}") from None
    try:
        return worker.run()
    except migrate.SchemaBehind as exc:
        raise SystemExit(f"trainyard worker: {exc}") from None
