"""Failing the jobs whose dependencies will never succeed, and giving jobs that wait on a sweep its best trial.

The server's background duties run this pass every quarter second (app/duties/loops.py); a burst worker
runs it once before it stops (worker/supervisor/main.py), so that a chain left with no server is not left queued for
ever. A pass rather than a hook in every transaction that ends a job (the queue's endings, a deletion): one
place sees every way a dependency ends, a deleted one included, at the cost of one indexed read. Each
failure is the queue's guarded UPDATE of a still-queued job, so passes in several processes (or hosts) at
once fail each job once.
"""
from sqlalchemy.engine import Engine

from trainyard.app.core.errors import NotFound
from trainyard.app.db import read, wakeup, write
from trainyard.app.fleet import dependencies
from trainyard.app.jobs import queue

MAX_CHAIN = 100  # rounds of one pass: a chain longer than that ends over several passes


def fail_dependents(engine: Engine) -> list[int]:
    """Fail (class dependency) each queued job that waits on a job that will never succeed; the ids it failed."""
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
