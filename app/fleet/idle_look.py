"""An idle worker's look at the queue: the full read (placement.startable, the claim's own) only when something
it depends on may have changed since the last look that found nothing; else one statement.

A worker with nothing to do looks again when woken (app/db/wakeup.py) and, as a safety net, every poll_s. Most of
those looks find what the last one found: nothing changed. So each look first reads the queue's mark, one
SELECT of small aggregates that move with every change that can give this worker a job:
  - the queue's events as app/db/counting.py counts them, in the transaction of each event: jobs submitted,
    ended (a device, a project's limit, a dependency freed), retried or requeued after a failure, preempted.
    Counters only go up, so their sum is the same only if no such event committed in between;
  - the running jobs' count: another worker's claim moves it (a head that did not fit here has gone);
  - the workers' count, and how many are draining and idle (an undrain; helpers for a multi-device job);
and, beside it, the worker's own slot (its free GPU memory, read before each look), device and plugins.
When a look was not woken, finds the same mark as the last one that found nothing, and that one is younger
than `every_s`, it answers "nothing" at once. Woken, it always reads in full: some wake-ups announce what no
counter counts (a sweep's best trial settling a dependency, worker/supervisor/part.py's ranks). What nothing counts or
announces (a project's limits raised, fair share's decay, a worker of another host coming back to life) is
seen by the full look that comes at least every `every_s` (the worker's lease_s).

No wake-up is lost to the mark: it is read before the full look (in the same snapshot on SQLite, a read
transaction; before it on PostgreSQL, whose reads are each their own), so a change that commits after the mark
was read either is seen by this full look or moves the mark that the next look compares.
"""
import math
import time

from sqlalchemy import case, func, select
from sqlalchemy.engine import Engine

from trainyard.app.core.states import JobState
from trainyard.app.db import counters as counter_rows
from trainyard.app.db import counting, jobs, read, workers
from trainyard.app.fleet import fair_share, placement

# The counters of the events that put a job in the queue or take it out of the queued and running states.
QUEUE_EVENTS = (counting.SUBMITTED, counting.FINISHED, counting.RETRIES, counting.PREEMPTIONS)

MARK = select(
    select(func.coalesce(func.sum(counter_rows.c.value), 0.0))
    .where(counter_rows.c.name.in_(QUEUE_EVENTS)).scalar_subquery().label("events"),
    select(func.count()).select_from(jobs).where(jobs.c.state == JobState.RUNNING.value)
    .scalar_subquery().label("running"),
    select(func.count()).select_from(workers).scalar_subquery().label("workers"),
    select(func.count(case((workers.c.draining.is_(True), 1)))).scalar_subquery().label("draining"),
    select(func.count(case((workers.c.state == "idle", 1)))).scalar_subquery().label("idle"),
)


class Look:
    """One worker's memory between its looks at the queue, and the claim cycle a look that found work begins."""

    def __init__(self, every_s: float = 15.0):
        self.every_s = every_s
        self.memo = fair_share.Memo()  # the claim cycle's fair-share reading (placement.startable)
        self._mark: tuple | None = None  # the last look's, when it found nothing
        self._at = -math.inf

    def forget(self) -> None:
        """The next look reads in full (a claim found nothing after all, or the worker ran a job)."""
        self._mark = None

    def claiming(self) -> fair_share.Memo:
        """The claim that ends this cycle takes its memo; whatever it finds, the next look reads in full."""
        memo, self.memo, self._mark = self.memo, fair_share.Memo(), None
        return memo


def has_work(engine: Engine, device: str, plugins: dict[str, list[str]] | None, worker_id: str | None,
             slot: placement.Slot | None, lease_s: float, look: Look | None, woken: bool) -> bool:
    """Whether the worker may claim now (placement.startable, without a lock); with its `look`, skipping the full
    read when the mark says nothing changed (the module's docstring)."""
    with read(engine) as conn:
        if look is None:
            return placement.startable(conn, device, plugins, worker_id, slot, lease_s, lock=False) is not None
        given = (device, tuple(sorted((k, tuple(v)) for k, v in (plugins or {}).items())), worker_id, slot)
        mark = (given, tuple(conn.execute(MARK).one()))
        now = time.monotonic()
        if not woken and mark == look._mark and now - look._at < look.every_s:
            return False
        look.memo = fair_share.Memo()  # a new claim cycle
        found = placement.startable(conn, device, plugins, worker_id, slot, lease_s, lock=False,
                                    memo=look.memo) is not None
    look._mark, look._at = (None, look._at) if found else (mark, now)
    return found
