"""The worker: register, claim, plan and supervise one job at a time, heartbeat, shut down.

One worker serves one device. It never imports torch and never initialises CUDA: jobs run in child
processes forked from a fork server that preloads torch (worker/runner.py), each supervised by
worker/supervise.py. Signal handlers only set flags; the loop does the work.
"""
import fcntl
import logging
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from sqlalchemy.exc import OperationalError

from trainyard.app import device_names, hardware, placement, plugins, queue, schema, wakeup
from trainyard.app import workers as registry
from trainyard.app.db import make_engine
from trainyard.app.layout import ARTIFACT_FILES, UPLOAD_DATA_FILE, UPLOAD_META_FILE
from trainyard.app.records import Job
from trainyard.app.settings import Settings
from trainyard.app.spec import uploads_named
from trainyard.app.states import Failure, error_record
from trainyard.worker import memory, runner_entry
from trainyard.worker.plan import JobPlan
from trainyard.worker.supervise import JobRun

log = logging.getLogger("trainyard.worker")
# The least time between two looks at the queue of an idle worker (see run()); the first look after a
# quiet spell is immediate.
LOOK_GAP_S = 0.02


def _mp_context() -> mp.context.BaseContext:
    # A fork server with torch preloaded: a plain fork of a process that touched CUDA is unsafe,
    # and spawn would pay for `import torch` on every job. "__main__" is whatever started this
    # worker (`trainyard`, `python -m trainyard`): a job process that re-imports it then finds it loaded.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "trainyard.worker.runner", "trainyard.worker.warm"])
    return ctx


class Worker:
    def __init__(self, settings: Settings, device: str = "auto", burst: bool = False,
                 max_jobs: int | None = None):
        self.settings = settings
        self.device = device_names.for_worker(device, hardware.visible_cuda_count() if device == "auto" else 0)
        self.burst = burst
        self.max_jobs = max_jobs
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
        self._marked_stopping = False
        self._last_look = 0.0
        self.listener: wakeup.Listener | None = None  # run() starts listening for queue changes

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
        if self.listener is not None:
            self.listener.interrupt()

    def run(self) -> int:
        self.settings.ensure_dirs()
        schema.prepare(self.engine)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        _pci_bus_order()
        self.ctx = _mp_context()
        offered = plugins.offered(self.settings.plugins)
        self.plugins = plugins.names(offered)  # what a job may need of this worker (the claim reads it)
        build = self._warm_up()
        # torch's devices by UUID (without CUDA: None, and CUDA_VISIBLE_DEVICES numbers NVML's GPUs)
        self.torch_uuids = [d.get("uuid") for d in build.get("cuda_devices") or []] \
            if build.get("cuda_available") else None
        reading = hardware.host_reading(self.device, self.torch_uuids)
        # Checked here, from what the warm-up child saw (the supervisor never touches CUDA): a worker that
        # cannot use its device registers as unavailable, with why, rather than fail every job it claims.
        self.unavailable = hardware.device_problem(self.device, build, reading, os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.slot = self._slot(reading, build)
        self.stats = {"build": build, "host": reading, "slot": asdict(self.slot), "unavailable": self.unavailable,
                      "plugins": self.plugins, "plugin_details": plugins.describe(offered)}
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
                        break
                    # Woken when the queue changes; poll_s is only the safety net. Heartbeats stay on time.
                    self.listener.wait(max(0.0, min(self.settings.poll_s, self._next_beat - time.monotonic())))
                    # A burst of submissions this worker cannot take (another device's, say) wakes it once
                    # per look, not once per job: looks are at least LOOK_GAP_S apart.
                    time.sleep(max(0.0, self._last_look + LOOK_GAP_S - time.monotonic()))
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
        return self.max_jobs is not None and self.jobs_done >= self.max_jobs

    def _next_job(self) -> Job | None:
        self._last_look = time.monotonic()
        try:
            self.housekeeping(state="idle", job_id=None)
            if self.unavailable:
                return None
            if self.db(queue.has_work, self.device, self.plugins, self.id, self.slot, self.settings.lease_s):
                return self.db(queue.claim, self.id, self.device, self.settings.lease_s, self.plugins, self.slot)
        except OperationalError:
            log.exception("database unavailable; the worker keeps trying")
            time.sleep(2.0)
        return None

    def _slot(self, reading: dict, build: dict | None = None) -> placement.Slot:
        """The device this worker claims for: a GPU by its UUID (workers on one GPU share it and its
        memory), the host's CPU when TRAINYARD_DEVICE_MEMORY_GB offers it memory, else its own."""
        budget = int(self.settings.device_memory_gb * 1e9) if self.settings.device_memory_gb else None
        if self.device.startswith("cuda"):
            own = next((g for g in reading["gpus"] if g["uuid"] == reading["device_uuid"]), None)
            # The GPU's UUID (NVML's, else torch's): a multi-device job pins its ranks by it.
            key = reading["device_uuid"] or f"{self.settings.node}/{self.device}"
            n = device_names.cuda_index(self.device)
            seen = (build or {}).get("cuda_devices") or []
            total = own["memory_total"] if own and own.get("memory_total") else \
                seen[n].get("total_memory") if n < len(seen) else None
            return placement.Slot(key, budget or total,
                                  headroom=self.settings.gpu_context_headroom_bytes)
        return placement.Slot(f"{self.settings.node}/cpu" if budget else self.id, budget)

    def _warm_up(self) -> dict:
        """Start the fork server now (it imports torch once, not on the first job) and ask a child
        what torch build the jobs will see."""
        parent, child = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=runner_entry.build_info, args=(child,))
        p.start()
        child.close()
        try:
            info = parent.recv() if parent.poll(300) else {}
        except EOFError:  # it died before answering (device_problem says so)
            info = {}
        if not info and p.is_alive():  # a CUDA initialisation that hangs must not hang the worker
            p.kill()
        p.join()
        parent.close()
        return info

    def housekeeping(self, state: str, job_id: int | None) -> None:
        """Heartbeat and sweep for lost jobs, at most every heartbeat_s. The API server sweeps too:
        any live process recovers a job whose worker vanished (see app.api._reap)."""
        now = time.monotonic()
        if now < self._next_beat:
            return
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
        self.db(registry.worker_heartbeat, self.id, state, job_id, self.stats)
        for jid, new_state in queue.requeue_expired(self.engine):
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
        self.db(registry.worker_heartbeat, self.id, registry.UNAVAILABLE, None, self.stats)

    def note_torch_memory(self, metrics: dict) -> None:
        """Keep a job's latest allocator stats for the next heartbeat (/devices shows them)."""
        mem = {k: v for k, v in metrics.items() if k in ("memory_allocated", "memory_reserved", "max_memory_allocated")}
        if mem:
            self.stats = {**self.stats, "torch": mem}

    # -- one job ----------------------------------------------------------------------------------

    def plan(self, job: Job) -> JobPlan:
        layout = self.settings.layout
        run_dir, stem = layout.run_dir(job.id, job.claim), layout.checkpoint_stem(job.id, job.claim)
        run_dir.mkdir(parents=True, exist_ok=True)
        stem.parent.mkdir(parents=True, exist_ok=True)
        here = self._live_workers_here()
        model_dir = model_spec = model_job = None
        field = "model_job" if job.kind == "predict" else "init_from"  # the job whose artifact this one uses
        if job.spec.get(field) is not None:
            model_job = self.db(queue.get_job, job.spec[field])
            if not model_job.artifact_path:
                raise FileNotFoundError(f"{field} {model_job.id} has no artifact")
            model_dir = layout.resolve(model_job.artifact_path)
            model_spec = model_job.spec if model_job.kind == "train" and job.kind == "predict" else None
        return JobPlan(
            job=job, device=self.device, data_dir=self.settings.data_dir, run_dir=run_dir, checkpoint_stem=stem,
            storage_url=self.settings.storage_url, fetch=self._fetch(job, model_job),
            ranks=tuple(r["device"] for r in job.ranks or ()),
            rank_uuids=tuple(r.get("key") if hardware.is_device_uuid(r.get("key")) else None for r in job.ranks or ()),
            resume_from=layout.resolve(job.checkpoint_path) if job.checkpoint_path else None,
            threads=max(1, (os.cpu_count() or 1) // max(1, len(here["cpu"]))) if self.device == "cpu" else None,
            memory_budget=memory.budget(self.settings.job_memory_bytes, self.settings.job_memory_share,
                                        memory.host_total(), len(here["all"])),
            gpu_memory_fraction=self._gpu_fraction(job), model_dir=model_dir, model_spec=model_spec,
            scratch_dir=self._scratch(job))

    def _scratch(self, job: Job) -> Path | None:
        """A run job's ctx.data_dir: a directory of its own for this run, not the service's data directory
        (the database is in it). What earlier runs of the job left (a worker killed) goes first."""
        if job.kind != "run":
            return None
        shutil.rmtree(self.settings.layout.scratch(job.id), ignore_errors=True)
        scratch = self.settings.layout.scratch(job.id, job.claim)
        scratch.mkdir(parents=True)
        return scratch

    def _fetch(self, job: Job, model_job: Job | None) -> tuple[str, ...]:
        """The stored files the job process needs on this host's disk before it starts (from a bucket:
        another host may have written them): the checkpoint it resumes from, the model a predict job
        uses or a train job starts from, the uploads its spec names."""
        keys = [job.checkpoint_path] if job.checkpoint_path else []
        if model_job is not None:
            keys += [f"{model_job.artifact_path}/{ARTIFACT_FILES[k]}" for k in ("meta", "safetensors")]
        keys += [f"{self.settings.layout.rel(self.settings.layout.upload(u))}/{name}"
                 for u in sorted(uploads_named(job.spec)) for name in (UPLOAD_META_FILE, UPLOAD_DATA_FILE)]
        return tuple(keys)

    def _gpu_fraction(self, job: Job) -> float | None:
        """A job that stated its GPU memory is held to it (torch's per-process fraction), so that its
        growth fails it with `oom`, not the job beside it on the same GPU."""
        if job.need_gpu_memory and self.slot.budget and self.device.startswith("cuda"):
            total = next((g["memory_total"] for g in self.stats["host"]["gpus"]
                          if g["uuid"] == self.slot.key), self.slot.budget)
            return min(1.0, job.need_gpu_memory / total)
        return self.settings.job_gpu_memory_fraction

    def _live_workers_here(self) -> dict[str, list]:
        """This host's live workers, all and CPU ones. CPU jobs share the cores among the CPU workers
        (two jobs each spinning two OpenMP threads on two cores run several times slower than two
        jobs with one thread each); every job shares the host's memory."""
        workers, now = self.db(registry.list_workers)
        here = [w for w in workers if w["host"] == self.settings.node
                and registry.worker_state(w, now, self.settings.lease_s) in registry.LIVE]
        return {"all": here, "cpu": [w for w in here if w["device"] == "cpu"]}

    def run_job(self, job: Job) -> None:
        log_path = self.settings.layout.log(job.id)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._fetch_log(job.id)
        try:
            plan = self.plan(job)
        except Exception as exc:  # e.g. the model job's artifact is gone: the job's own problem
            self.db(queue.fail, job.id, job.claim, error_record(Failure.JOB, type(exc).__name__, str(exc)))
            return
        parent_conn, child_conn = self.ctx.Pipe(duplex=False)
        # The job's stdout and stderr: a pipe the supervisor copies to the log, held to its cap (worker/joblog.py).
        output, output_w = self.ctx.Pipe(duplex=False)
        _widen(output)
        proc = self.ctx.Process(target=runner_entry.run, name=f"trainyard-job-{job.id}",
                                args=(plan, child_conn, output_w))
        proc.start()
        child_conn.close()
        output_w.close()
        run = JobRun(worker=self, plan=plan, proc=proc, conn=parent_conn, log_path=log_path, output=output)
        threads = f", {plan.threads} torch threads" if plan.threads else ""
        run.log(f"attempt {job.attempt} (run {job.claim}) on {self.id} ({self.device}{threads}, memory budget "
                f"{memory.gib(plan.memory_budget)}), job process pid {proc.pid}")
        try:
            run.supervise()
        except OperationalError:
            # We can no longer report for this job: stop it. Its lease runs out and the job is
            # requeued (from its last recorded checkpoint) for whichever worker reaches the database.
            log.exception("database unreachable while running job %s; stopping it", job.id)
            run.stop_now()
        run.end_processes()
        parent_conn.close()
        if plan.scratch_dir is not None:
            shutil.rmtree(self.settings.layout.scratch(job.id), ignore_errors=True)
        run.sum_up()
        run.publish_log()  # with the lines written after the job's end was recorded
        if run.outcome == "succeeded":
            try:
                self.settings.store.delete_prefix(self.settings.layout.rel(self.settings.layout.checkpoints(job.id)))
            except Exception as exc:
                log.warning("job %s: could not delete its checkpoints: %s", job.id, exc)

    def _fetch_log(self, job_id: int) -> None:
        """A job resumed on this host goes on with the log its earlier runs (on other hosts) wrote."""
        store = self.settings.store
        if store.remote:
            try:
                store.fetch(self.settings.layout.rel(self.settings.layout.log(job_id)), refresh=True)
            except FileNotFoundError:
                pass
            except Exception as exc:
                log.warning("job %s: earlier log not fetched from %s: %s", job_id, store.describe(), exc)


def _widen(output) -> None:
    """The output pipe's read end: non-blocking (the supervisor reads what is there), and as large as
    the host allows (up to 1 MiB), so a job printing fast waits less while the supervisor is busy."""
    os.set_blocking(output.fileno(), False)
    try:
        fcntl.fcntl(output.fileno(), 1031, 1 << 20)  # F_SETPIPE_SZ
    except OSError:
        pass  # past /proc/sys/fs/pipe-max-size: the default 64 KiB works, more slowly


def _pci_bus_order() -> None:
    """CUDA numbers GPUs fastest first unless told otherwise, NVML by PCI bus: on a mixed host the two
    name different cards by one index. PCI bus order for the warm-up and every job process (children
    of this one) makes CUDA_VISIBLE_DEVICES's integers mean what NVML's indices do; the worker's own
    GPU is matched by UUID either way."""
    if os.environ.get("CUDA_DEVICE_ORDER") not in (None, "PCI_BUS_ID"):
        log.warning("CUDA_DEVICE_ORDER=%s replaced by PCI_BUS_ID", os.environ["CUDA_DEVICE_ORDER"])
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"


def main(settings: Settings, device: str, burst: bool = False, max_jobs: int | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        worker = Worker(settings, device, burst=burst, max_jobs=max_jobs)
    except ValueError as exc:
        raise SystemExit(f"trainyard worker: --device {exc}") from None
    try:
        return worker.run()
    except schema.SchemaBehind as exc:
        raise SystemExit(f"trainyard worker: {exc}") from None
