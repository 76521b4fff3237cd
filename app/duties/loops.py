"""The server's background duties: the lease reaper, the sweeps' driver, the failing of jobs whose
dependencies will never succeed, the storage collector (app/lifecycle/collector.py) and the preemption pass
(app/fleet/preemption.py) and, where the service tracks, the MLflow sender (app/tracking/), each a thread of its
own.

The reaper and the driver run in every server process and do their work in one per host, the holder of a file
lock (settings.layout's housekeeping and sweeps locks); the collector and the preemption pass run in the process
whose reaper holds the housekeeping lock: `serve --workers N` starts N processes, and if the holder dies the
lock is free and another takes over. `Duties.start` is called when the app starts serving, `stop` when it shuts
down.
"""
import fcntl
import importlib.util
import logging
import os
import threading
from pathlib import Path

from sqlalchemy.engine import Engine

from trainyard.app.core.settings import Settings
from trainyard.app.duties import dependents
from trainyard.app.fleet import preemption
from trainyard.app.jobs import queue
from trainyard.app.lifecycle import collector
from trainyard.app.sweeps import search
from trainyard.app.tracking import mlflow_runs

log = logging.getLogger("trainyard.api")
# How often queued jobs are checked for a dependency that failed, was cancelled, pruned or deleted.
DEPENDENCY_PASS_S = 0.25
# How often the housekeeper looks for a queued job that should preempt a running one.
PREEMPTION_PASS_S = 1.0


class Duties:
    """The server's background threads; `searcher` is the sweeps' driver (routes poke it to start trials now)."""

    def __init__(self, engine: Engine, settings: Settings):
        self.stopping = threading.Event()
        self.searcher = search.Searcher(engine, settings)
        self.housekeeper = threading.Event()  # set once this process holds the housekeeping lock
        layout = settings.layout
        self.threads = [
            threading.Thread(target=reap, args=(engine, settings.lease_s / 3, self.stopping, layout.housekeeping_lock,
                                                self.housekeeper), daemon=True, name="lease-reaper"),
            threading.Thread(target=collect, args=(engine, settings, self.stopping, self.housekeeper),
                             daemon=True, name="collector"),
            threading.Thread(target=preempt, args=(engine, settings, self.stopping, self.housekeeper),
                             daemon=True, name="preemption"),
            threading.Thread(target=self.searcher.run, args=(self.stopping, layout.sweeps_lock),
                             daemon=True, name="sweeps"),
            threading.Thread(target=watch_dependencies, args=(engine, DEPENDENCY_PASS_S, self.stopping),
                             daemon=True, name="dependencies"),
        ]
        if settings.mlflow_tracking_uri:
            if importlib.util.find_spec("mlflow") is None:
                raise RuntimeError("TRAINYARD_MLFLOW_TRACKING_URI is set, but MLflow's client is not installed here: "
                                   "pip install 'trainyard[mlflow]' (or unset it)")
            self.threads.append(threading.Thread(target=track, args=(engine, settings, self.stopping, self.housekeeper),
                                                 daemon=True, name="mlflow"))

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.searcher.poke()  # it may be waiting for work: let it see the stop now
        for thread in self.threads:
            thread.join(timeout=5)


def reap(engine: Engine, every_s: float, stop: threading.Event, lock_path: Path, held_flag: threading.Event) -> None:
    """Requeue jobs whose worker vanished, even when no worker is left to notice.

    Workers run the same sweep in their housekeeping, on purpose: with several hosts, any live
    process that can reach the database recovers a lost job, whether or not this server is up.
    requeue_expired is fenced per job, so several sweeps at once requeue each job once; the cost
    is one indexed read per sweep. Of a host's server processes only the one holding the
    housekeeping lock sweeps."""
    held = False
    with open(lock_path, "a") as lock:
        while not stop.wait(every_s):
            if not held:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # another server process of this host sweeps
                held = True
                held_flag.set()
                log.info("lease reaper: server process %s sweeps for this host", os.getpid())
            try:
                for job_id, state in queue.requeue_expired(engine):
                    log.warning("job %s lost its worker (lease expired): now %s", job_id, state)
            except Exception:
                log.exception("lease reaper")


def watch_dependencies(engine: Engine, every_s: float, stop: threading.Event) -> None:
    """Run fail_dependents every every_s seconds until stopped."""
    while not stop.wait(every_s):
        try:
            for job_id in dependents.fail_dependents(engine):
                log.info("job %s failed: a job it waits for will not succeed", job_id)
        except Exception:
            log.exception("dependencies")


def collect(engine: Engine, settings: Settings, stop: threading.Event, housekeeper: threading.Event) -> None:
    """A collector's pass every settings.collect_s, once this process is its host's housekeeper."""
    while not stop.wait(settings.collect_s):
        if not housekeeper.is_set():
            continue
        try:
            report = collector.collect(engine, settings)
            log.info("collector: %d objects (%d bytes) removed, %d jobs deleted, %d trials reclaimed in %.1f s",
                     report.deleted_objects, report.deleted_bytes, report.jobs_deleted, report.trials_reclaimed,
                     report.took_s)
        except Exception:
            log.exception("collector")


def track(engine: Engine, settings: Settings, stop: threading.Event, housekeeper: threading.Event) -> None:
    """The MLflow sender's pass every mlflow_runs.PASS_S, in the host's housekeeper process (app/tracking/)."""
    sender = None
    while not stop.wait(mlflow_runs.PASS_S):
        if not housekeeper.is_set():
            continue
        try:
            sender = sender or mlflow_runs.Sender(engine, settings)
            sender.run_pass()
        except Exception:
            log.exception("MLflow sender")


def preempt(engine: Engine, settings: Settings, stop: threading.Event, housekeeper: threading.Event) -> None:
    """A preemption pass every PREEMPTION_PASS_S, in the host's housekeeper process only (two passes at once
    would each ask a victim of one device class)."""
    while not stop.wait(PREEMPTION_PASS_S):
        if not housekeeper.is_set():
            continue
        try:
            preemption.run_pass(engine, settings)
        except Exception:
            log.exception("preemption")
