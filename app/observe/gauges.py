"""Prometheus gauges: how things stand, read from the current rows at each scrape (app/observe/prometheus.py serves
them).

A gauge may go down (a job leaves the queue, a row is deleted), so rows are the right source here; what
happened (counters, the duration histogram) is app/db/counting.py's. Label values are bounded: a job's
kind and state (the enums), the device it asked for, why it waits as a class (waiting.Waiting), the
registered workers, and the store's kinds of object (collector.KINDS).

A user who is not an admin gets the gauges of their project's rows only (jobs, the queue, running jobs'
speed, sweeps and trials) and the fleet's workers, but not the store's (it is not kept per project).
"""
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy import ColumnElement, case, func, select, true
from sqlalchemy.engine import Connection, Engine

from trainyard.app.accounts import Principal, project_rows
from trainyard.app.core.states import SWEEP_STATES, Failure, JobState
from trainyard.app.db import jobs, read, sweeps, tracked_runs
from trainyard.app.fleet import dependencies, waiting
from trainyard.app.fleet import workers as registry
from trainyard.app.lifecycle import collector
from trainyard.app.records import Job
from trainyard.app.records.sweep_results import COUNT_KEYS
from trainyard.app.spec import JOB_KINDS

# What waiting.waiting reads of a queued job: jobs alike in these wait for the same reason.
_PLACED = (jobs.c.device_req, jobs.c.devices, jobs.c.need_model, jobs.c.need_dataset, jobs.c.need_entrypoint,
           jobs.c.need_gpu_memory, jobs.c.runs_on)


def seen_by(table, who: Principal | None) -> ColumnElement[bool]:
    """The rows of jobs or sweeps `who` sees (all: an admin, or no one named), as a WHERE clause."""
    found = project_rows(table, who)
    return true() if found is None else found


def read_rows(engine: Engine, stale_after_s: float, who: Principal | None = None) -> dict[str, Any]:
    """What the gauges show, in one read: jobs by kind and state, the queue, running jobs' speed, sweeps and
    their trials (those `who` sees), the workers with the database's clock, and the store as the collector last
    measured it (None for a user who is not an admin)."""
    listed, now = registry.list_workers(engine)
    storage = collector.usage(engine) if who is None or who.admin else None
    mine = seen_by(jobs, who)
    with read(engine) as conn:
        by_state = conn.execute(select(jobs.c.kind, jobs.c.state, func.count()).where(mine)
                                .group_by(jobs.c.kind, jobs.c.state)).all()
        running = conn.execute(select(jobs.c.id, jobs.c.device, jobs.c.latest_metrics)
                               .where(jobs.c.state == JobState.RUNNING, mine)).all()
        sweep_states = conn.execute(select(sweeps.c.state, func.count()).where(seen_by(sweeps, who))
                                    .group_by(sweeps.c.state)).all()
        # The tracker's backlog (app/tracking/): runs with something not yet sent, and those whose last send failed.
        tracking = tuple(conn.execute(select(func.count(), func.count(tracked_runs.c.error))
                                      .where(tracked_runs.c.pending)).one()) if who is None or who.admin else None
        return {"tracking": tracking, "by_state": {(k, s): n for k, s, n in by_state},
                "queue": _queue(conn, listed, now, stale_after_s, mine), "running": running,
                "sweeps": dict(sweep_states), "trials": _trials(conn, mine), "workers": listed, "now": now,
                "storage": storage}


def _queue(conn: Connection, listed: list[dict], now: float, stale_after_s: float,
           mine: ColumnElement[bool]) -> dict[tuple[str, str], list[float]]:
    """(device asked for, why it waits) -> [queued jobs, the oldest one's seconds in the queue]."""
    since = func.min(func.coalesce(jobs.c.queued_at, jobs.c.created_at)).label("since")
    blocked = case((dependencies.ready(), False), else_=True).label("blocked")
    groups = conn.execute(select(*_PLACED, blocked, func.count().label("n"), since)
                          .where(jobs.c.state == JobState.QUEUED, mine)
                          .group_by(*_PLACED, blocked)).all()
    live = registry.still_placing(listed, now, stale_after_s)
    out: dict[tuple[str, str], list[float]] = {}
    for group in groups:
        job = Job.from_values({**{k: v for k, v in group._mapping.items() if k != "blocked"}, "state": JobState.QUEUED})
        # Waiting on other jobs comes first: no worker can take it before they succeed, whatever the workers. A
        # Slurm job waits for its allocation, which no worker of the own fleet (an autoscaler's to add) would end.
        if group.blocked:
            found: tuple[waiting.Waiting, str] | None = (waiting.Waiting.DEPENDENCY, "")
        else:
            found = (waiting.Waiting.SLURM, "") if job.runs_on == "slurm" else waiting.waiting(job, live)
        key = (job.device_req, (found[0] if found else waiting.Waiting.TURN).value)
        depth, age = out.get(key, [0, 0.0])
        out[key] = [depth + group.n, max(age, now - group.since)]
    return out


def _trials(conn: Connection, mine: ColumnElement[bool]) -> dict[str, int]:
    """Sweeps' trials by state; a trial a release before the pruned state failed as pruned counts as pruned."""
    trials = conn.execute(select(jobs.c.state, func.count()).where(jobs.c.sweep_id.is_not(None), mine)
                          .group_by(jobs.c.state)).all()
    failed = conn.execute(select(jobs.c.error).where(jobs.c.sweep_id.is_not(None), mine,
                                                     jobs.c.state == JobState.FAILED)).scalars().all()
    counts = dict.fromkeys(COUNT_KEYS, 0) | {s: n for s, n in trials}
    legacy = sum((e or {}).get("class") == Failure.PRUNED for e in failed)
    counts["pruned"] = counts.get("pruned", 0) + legacy
    counts[JobState.FAILED.value] -= legacy
    return counts


def families(st: dict[str, Any]) -> Iterator[Metric]:
    """Jobs by state, the queue by device and reason, workers' heartbeat age, speeds, sweeps and trials, storage."""
    by_state = GaugeMetricFamily("trainyard_jobs", "Jobs by kind and state", labels=["kind", "state"])
    for kind in JOB_KINDS:
        for state in JobState:
            by_state.add_metric([kind, state.value], st["by_state"].get((kind, state.value), 0))
    yield by_state

    labels = ["device", "reason"]
    depth = GaugeMetricFamily("trainyard_queue_depth", "Queued jobs by the device they asked for and why they wait "
                              "(turn: a live worker can take them)", labels=labels)
    oldest = GaugeMetricFamily("trainyard_queue_oldest_job_age_seconds",
                               "Seconds the longest-waiting queued job has been in the queue (since its submit, "
                               "retry or requeue)", labels=labels)
    for (device, reason), (n, age) in sorted(st["queue"].items()):
        depth.add_metric([device, reason], n)
        oldest.add_metric([device, reason], max(0.0, age))
    yield from (depth, oldest)

    beat = GaugeMetricFamily("trainyard_worker_heartbeat_age_seconds",
                             "Seconds since each registered (not stopped) worker's last heartbeat",
                             labels=["worker", "host", "device"])
    for w in st["workers"]:
        beat.add_metric([w["id"], w["host"], w["device"]], max(0.0, st["now"] - w["last_heartbeat"]))
    yield beat

    speed = GaugeMetricFamily("trainyard_job_samples_per_second", "Training speed of running jobs (last epoch)",
                              labels=["job_id", "device"])
    for r in st["running"]:
        samples = (r.latest_metrics or {}).get("samples_per_s")
        if samples is not None:
            speed.add_metric([str(r.id), r.device or ""], samples)
    yield speed

    swept = GaugeMetricFamily("trainyard_sweeps", "Sweeps by state", labels=["state"])
    for sweep_state in SWEEP_STATES:
        swept.add_metric([sweep_state], st["sweeps"].get(sweep_state, 0))
    yield swept
    trials = GaugeMetricFamily("trainyard_sweep_trials", "Sweeps' trials by state", labels=["state"])
    for trial_state, n in st["trials"].items():
        trials.add_metric([trial_state], n)
    yield trials
    if st["storage"] is not None:
        yield from _storage(st["storage"])
    if st.get("tracking") is not None:
        pending, failing = st["tracking"]
        yield GaugeMetricFamily("trainyard_tracking_backlog_runs", "Jobs' and sweeps' MLflow runs with records not "
                                "yet sent to the tracker (running jobs' included: they send at each checkpoint)",
                                value=pending)
        yield GaugeMetricFamily("trainyard_tracking_failing_runs", "Of those, the runs whose last send to the "
                                "tracker failed (it is tried again, backing off)", value=failing)


def _storage(usage: list[collector.Usage]) -> Iterator[Metric]:
    """Every kind, 0 before the collector's first pass: an alert on growth sees the series from the start."""
    size = GaugeMetricFamily("trainyard_storage_bytes", "Bytes the store holds by kind of object, as the collector's "
                             "last pass measured them (cache: this host's copies of bucket objects)", labels=["kind"])
    count = GaugeMetricFamily("trainyard_storage_objects", "Objects the store holds by kind, as the collector's "
                              "last pass counted them", labels=["kind"])
    for u in usage:
        size.add_metric([u.kind], u.bytes)
        count.add_metric([u.kind], u.objects)
    yield from (size, count)
