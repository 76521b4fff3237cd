"""Prometheus counters and the job-duration histogram, kept in the database (the counters table).

A counter counts events, so it is added to by the transaction of the event it counts (the queue's guarded,
fenced UPDATEs, the submit's INSERT): it moves exactly when the event commits, once however many
servers scrape, and only ever up, whatever later happens to the rows (a retry puts a failed job back in
the queue, a deletion removes it). Counting rows at each scrape instead made a retried job's run vanish
from the duration histogram, which Prometheus reads as a counter reset.

Each event's increments go in one INSERT .. ON CONFLICT DO UPDATE, in key order, after the event's own
UPDATE: a transaction locks its jobs' rows before any counter row (queue.stop, which ends several jobs,
locks them all first), so none holds a counter row while waiting for a job's (PostgreSQL: no deadlock),
and a hot counter row is held only until that transaction commits. The histogram is stored as the count
of observations in each bucket (not cumulative, so an observation adds to one bucket's row) plus a sum;
the reader (app/observe/prometheus.py) accumulates them.
"""
import json
import math
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from trainyard.app.core.states import TERMINAL, JobState
from trainyard.app.db import counters, jobs

SUBMITTED = "trainyard_jobs_submitted_total"    # {kind}
FINISHED = "trainyard_jobs_finished_total"      # {kind, state}: every job that reached an end state
FAILURES = "trainyard_job_failures_total"       # {class}: every error a job's history records
RETRIES = "trainyard_job_retries_total"         # {trigger}: back in the queue under the same id
PREEMPTIONS = "trainyard_job_preemptions_total"  # running jobs put back by their worker's shutdown
LEASE_EXPIRIES = "trainyard_job_lease_expiries_total"  # running jobs whose worker stopped renewing the lease
DURATION = "trainyard_job_duration_seconds"     # {kind, state, le}: the last run of a job that ended running
DURATION_SUM = DURATION + "_sum"                # {kind, state}

COLLECTED = "trainyard_storage_deleted_objects_total"  # {kind}: unreferenced objects the collector removed
COLLECTED_BYTES = "trainyard_storage_deleted_bytes_total"  # {kind}
COLLECTIONS = "trainyard_storage_collections_total"  # the collector's passes
TRACKER_ERRORS = "trainyard_tracking_errors_total"  # {tracker}: sends to an experiment tracker that failed
TRACKER_SENDS = "trainyard_tracking_sends_total"  # {tracker}: runs brought up to date in a tracker

# The columns `ended` reads of the updated row (UPDATE .. RETURNING).
ENDED = (jobs.c.kind, jobs.c.state, jobs.c.error, jobs.c.started_at, jobs.c.finished_at)
BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0, math.inf)

# The states a job ends in (whatever app/core/states.py adds): the label values of FINISHED and DURATION.
ENDINGS = tuple(s.value for s in TERMINAL)


class Trigger(StrEnum):
    """Why a job went back to the queue under its id (RETRIES' label)."""
    REQUEST = "request"    # POST /jobs/{id}/retry of a job that ended other than succeeded
    FAILURE = "failure"    # a retryable failure (a lost worker) with attempts left


# Series (name, labels as stored) and how much to add to each.
Tally = dict[tuple[str, str], float]


def _key(name: str, **labels: str) -> tuple[str, str]:
    return name, json.dumps(labels, sort_keys=True, separators=(",", ":"))


def submitted(kind: str) -> Tally:
    return {_key(SUBMITTED, kind=kind): 1}


def failed(error: Mapping[str, Any] | None) -> Tally:
    """A run (or a queued job, cancelled) ended with this error record."""
    return {_key(FAILURES, **{"class": str(error.get("class"))}): 1} if error else {}


def ended(left: str, row: Any) -> Tally:
    """A job left state `left` for an end state; row: its row as updated (ENDED), None when the guarded UPDATE
    changed nothing (nothing to count). A job that ended while running adds its run's duration to the histogram."""
    if row is None:
        return {}
    kind, state = row.kind, str(row.state)
    tally = {_key(FINISHED, kind=kind, state=state): 1.0, **failed(row.error)}
    if left == JobState.RUNNING and row.started_at is not None and row.finished_at is not None:
        seconds = max(0.0, row.finished_at - row.started_at)
        le = next(b for b in BUCKETS if seconds <= b)
        tally[_key(DURATION, kind=kind, state=state, le=_le(le))] = 1
        tally[_key(DURATION_SUM, kind=kind, state=state)] = seconds
    return tally


def requeued(trigger: Trigger, error: Mapping[str, Any] | None = None) -> Tally:
    """A job went back to the queue: retried on request, or after a retryable failure (`error`)."""
    return {_key(RETRIES, trigger=trigger.value): 1, **failed(error)}


def preempted() -> Tally:
    return {_key(PREEMPTIONS): 1}


def lease_expired() -> Tally:
    return {_key(LEASE_EXPIRIES): 1}


def collected(deleted: list[tuple[str, int]]) -> Tally:
    """A collector's pass that removed these (kind, bytes) objects."""
    tally: Tally = {_key(COLLECTIONS): 1.0}
    for kind, size in deleted:
        for name, value in ((COLLECTED, 1.0), (COLLECTED_BYTES, float(size))):
            tally[_key(name, kind=kind)] = tally.get(_key(name, kind=kind), 0.0) + value
    return tally


def tracker(ok: bool, count: int = 1, name: str = "mlflow") -> Tally:
    """Sends of jobs' or sweeps' runs to a tracker (app/tracking/) that worked, or failed."""
    return {_key(TRACKER_SENDS if ok else TRACKER_ERRORS, tracker=name): count}


def add(conn: Connection, *tallies: Tally) -> None:
    """Add the tallies of an event inside its transaction: one statement, rows in key order."""
    total: Tally = {}
    for tally in tallies:
        for key, amount in tally.items():
            total[key] = total.get(key, 0.0) + amount
    if not total:
        return
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(counters).values([{"name": name, "labels": labels, "value": float(value)}
                                            for (name, labels), value in sorted(total.items())])
    conn.execute(stmt.on_conflict_do_update(index_elements=[counters.c.name, counters.c.labels],
                                            set_={"value": counters.c.value + stmt.excluded.value}))


def read(conn: Connection) -> Iterable[tuple[str, dict[str, str], float]]:
    """Every series: (name, labels, value), in one statement (one snapshot)."""
    rows = conn.execute(select(counters.c.name, counters.c.labels, counters.c.value)).all()
    return [(name, json.loads(labels), value) for name, labels, value in rows]


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)
