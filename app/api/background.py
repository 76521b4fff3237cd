"""The server's background duties: the lease reaper, the sweeps' driver and the failing of jobs whose
dependencies will never succeed, each a thread of its own.

Both run in every server process and do their work in one per host, the holder of a file lock
(settings.layout's housekeeping and sweeps locks): `serve --workers N` starts N processes, and if the
holder dies the lock is free and another takes over. `Duties.start` is called when the app starts
serving, `stop` when it shuts down.
"""
import fcntl
import logging
import os
import threading
from pathlib import Path

from sqlalchemy.engine import Engine

from trainyard.app import dependencies, queue, search, wakeup
from trainyard.app.db import read, write
from trainyard.app.errors import NotFound
from trainyard.app.settings import Settings

log = logging.getLogger("trainyard.api")
# How often queued jobs are checked for a dependency that failed, was cancelled, pruned or deleted.
DEPENDENCY_PASS_S = 0.25
MAX_CHAIN = 100  # rounds of one pass: a chain longer than that ends over several passes


class Duties:
    """The server's background threads; `searcher` is the sweeps' driver (routes poke it to start trials now)."""

    def __init__(self, engine: Engine, settings: Settings):
        self.stopping = threading.Event()
        self.searcher = search.Searcher(engine, settings)
        layout = settings.layout
        self.threads = [
            threading.Thread(target=reap, args=(engine, settings.lease_s / 3, self.stopping, layout.housekeeping_lock),
                             daemon=True, name="lease-reaper"),
            threading.Thread(target=self.searcher.run, args=(self.stopping, layout.sweeps_lock),
                             daemon=True, name="sweeps"),
            threading.Thread(target=watch_dependencies, args=(engine, DEPENDENCY_PASS_S, self.stopping),
                             daemon=True, name="dependencies"),
        ]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.searcher.poke()  # it may be waiting for work: let it see the stop now
        for thread in self.threads:
            thread.join(timeout=5)


def reap(engine: Engine, every_s: float, stop: threading.Event, lock_path: Path) -> None:
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
                log.info("lease reaper: server process %s sweeps for this host", os.getpid())
            try:
                for job_id, state in queue.requeue_expired(engine):
                    log.warning("job %s lost its worker (lease expired): now %s", job_id, state)
            except Exception:
                log.exception("lease reaper")


def fail_dependents(engine: Engine) -> list[int]:
    """Fail (class dependency) each queued job that waits on a job that will never succeed; the ids it failed.

    A pass here rather than in every transaction that ends a job (the queue's endings, a deletion): one
    place sees every way a dependency ends, a deleted one included, at the cost of one indexed read. Each
    failure is the queue's guarded UPDATE of a still-queued job, so passes in several server processes (or
    hosts) at once fail each job once."""
    failed = settle_sweeps(engine)
    for _ in range(MAX_CHAIN):  # a job failed here fails the jobs that wait on it in the next round
        with read(engine) as conn:
            found = dependencies.broken(conn)
        ended = [job_id for job_id, (after_id, state) in found.items()
                 if queue.stop(engine, [job_id], dependencies.failure(after_id, state), states=(queue.QUEUED,),
                               final=queue.FAILED)]
        if not ended:
            break
        failed += ended
    return failed


def settle_sweeps(engine: Engine) -> list[int]:
    """Each queued job waiting on a sweep that has ended gets its best trial (then waits on that job, which
    succeeded), or fails (class dependency) when there is none; the ids it failed."""
    failed = []
    with read(engine) as conn:
        ended = dependencies.sweeps_ended(conn)
    for job_id, sweep_id, field, state in ended:
        try:
            best = None if state is None else dependencies.best_of(engine, sweep_id)
        except NotFound:  # deleted since
            best, state = None, None
        if best is None:
            error = dependencies.sweep_failure(sweep_id, state)
            failed += queue.stop(engine, [job_id], error, states=(queue.QUEUED,), final=queue.FAILED)
            continue
        with write(engine) as conn:
            if dependencies.settle(conn, job_id, field, best):
                wakeup.notify(conn)
    return failed


def watch_dependencies(engine: Engine, every_s: float, stop: threading.Event) -> None:
    """Run fail_dependents every every_s seconds until stopped."""
    while not stop.wait(every_s):
        try:
            for job_id in fail_dependents(engine):
                log.info("job %s failed: a job it waits for will not succeed", job_id)
        except Exception:
            log.exception("dependencies")
