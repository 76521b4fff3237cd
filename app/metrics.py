"""Prometheus metrics: the queue, sweeps, the workers and the devices, read fresh at every scrape.

Nothing is counted in the server's memory: with several servers (or a restart) the numbers come
from the shared database, so every scrape of any server tells the same story.
"""
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from sqlalchemy import case, func, select
from sqlalchemy.engine import Engine

from trainyard.app import devices_payload
from trainyard.app.db import jobs, read, sweeps
from trainyard.app.spec import JOB_KINDS
from trainyard.app.states import SWEEP_STATES, Failure, JobState
from trainyard.app.sweep_results import COUNT_KEYS

DURATION_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


def stats(engine: Engine, buckets: tuple[float, ...]) -> dict[str, Any]:
    """Aggregates for monitoring, computed by the database: jobs by kind and state, a histogram of
    finished jobs' durations (cumulative counts per bucket, sum, count), and running jobs' speed."""
    duration = jobs.c.finished_at - jobs.c.started_at
    finished = jobs.c.state.in_((JobState.SUCCEEDED, JobState.FAILED)) & jobs.c.started_at.is_not(None)
    with read(engine) as conn:
        by_state = conn.execute(select(jobs.c.kind, jobs.c.state, func.count())
                                .group_by(jobs.c.kind, jobs.c.state)).all()
        hist = conn.execute(select(
            jobs.c.kind, func.count(), func.coalesce(func.sum(duration), 0.0),
            *[func.sum(case((duration <= b, 1), else_=0)) for b in buckets],
        ).where(finished).group_by(jobs.c.kind)).all()
        running = conn.execute(select(jobs.c.id, jobs.c.kind, jobs.c.device, jobs.c.latest_metrics)
                               .where(jobs.c.state == JobState.RUNNING)).all()
        sweep_states = conn.execute(select(sweeps.c.state, func.count()).group_by(sweeps.c.state)).all()
        trials = conn.execute(select(jobs.c.state, func.count()).where(jobs.c.sweep_id.is_not(None))
                              .group_by(jobs.c.state)).all()
        failed_trials = conn.execute(select(jobs.c.error).where(jobs.c.sweep_id.is_not(None),
                                                                jobs.c.state == JobState.FAILED)).scalars().all()
    trial_counts = dict.fromkeys(COUNT_KEYS, 0) | {s: n for s, n in trials}
    trial_counts["pruned"] = sum((e or {}).get("class") == Failure.PRUNED for e in failed_trials)
    trial_counts[JobState.FAILED.value] -= trial_counts["pruned"]
    return {
        "sweeps": {s: n for s, n in sweep_states},
        "trials": trial_counts,
        "by_state": {(k, s): n for k, s, n in by_state},
        "durations": {row[0]: {"count": row[1], "sum": float(row[2]), "buckets": [int(v or 0) for v in row[3:]]}
                      for row in hist},
        "running": [{"id": r.id, "kind": r.kind, "device": r.device,
                     "samples_per_s": (r.latest_metrics or {}).get("samples_per_s")} for r in running],
    }



class _Collector:
    def __init__(self, engine: Engine, stale_after_s: float, node: str | None = None):
        self.engine = engine
        self.stale_after_s = stale_after_s
        self.node = node

    def collect(self) -> Iterator[Metric]:
        st = stats(self.engine, DURATION_BUCKETS)
        yield from _job_families(st)
        yield from _device_families(devices_payload.snapshot(self.engine, self.stale_after_s, self.node))


def _job_families(st: dict) -> Iterator[Metric]:
    """Jobs by state, the queue, run times and speeds; sweeps and their trials by state."""
    by_state = GaugeMetricFamily("trainyard_jobs", "Jobs by kind and state", labels=["kind", "state"])
    for kind in JOB_KINDS:
        for state in JobState:
            by_state.add_metric([kind, state.value], st["by_state"].get((kind, state.value), 0))
    yield by_state
    yield GaugeMetricFamily("trainyard_queue_depth", "Jobs waiting for a worker",
                            value=sum(n for (_, s), n in st["by_state"].items() if s == JobState.QUEUED))

    hist = HistogramMetricFamily("trainyard_job_duration_seconds", "Run time of finished jobs (latest run)",
                                 labels=["kind"])
    for kind, h in st["durations"].items():
        buckets = [(repr(b), n) for b, n in zip(DURATION_BUCKETS, h["buckets"])] + [("+Inf", h["count"])]
        hist.add_metric([kind], buckets, h["sum"])
    yield hist

    speed = GaugeMetricFamily("trainyard_job_samples_per_second", "Training speed of running jobs (last epoch)",
                              labels=["job_id", "device"])
    for r in st["running"]:
        if r["samples_per_s"] is not None:
            speed.add_metric([str(r["id"]), r["device"] or ""], r["samples_per_s"])
    yield speed

    swept = GaugeMetricFamily("trainyard_sweeps", "Sweeps by state", labels=["state"])
    for sweep_state in SWEEP_STATES:
        swept.add_metric([sweep_state], st["sweeps"].get(sweep_state, 0))
    yield swept
    trials = GaugeMetricFamily("trainyard_sweep_trials", "Sweeps' trials by state (pruned apart from failed)",
                               labels=["state"])
    for trial_state, n in st["trials"].items():
        trials.add_metric([trial_state], n)
    yield trials


def _device_families(payload: dict) -> Iterator[Metric]:
    """Live workers and GPU memory per device of each host (GET /devices' payload)."""
    alive = GaugeMetricFamily("trainyard_workers_alive", "Workers with a recent heartbeat",
                              labels=["host", "device"])
    gpu_labels = ["host", "device", "uuid"]
    used = GaugeMetricFamily("trainyard_device_memory_used_bytes", "GPU memory in use (NVML)", labels=gpu_labels)
    total = GaugeMetricFamily("trainyard_device_memory_total_bytes", "GPU memory (NVML)", labels=gpu_labels)
    worker_labels = ["host", "device", "worker"]
    allocated = GaugeMetricFamily("trainyard_torch_memory_allocated_bytes",
                                  "torch.cuda.memory_allocated of each worker's job", labels=worker_labels)
    reserved = GaugeMetricFamily("trainyard_torch_memory_reserved_bytes",
                                 "torch.cuda.memory_reserved of each worker's job", labels=worker_labels)
    for host in payload["hosts"]:
        groups = [(f"cuda:{d['index']}" if d["index"] is not None else "gpu", d["workers"], d)
                  for d in host["cuda_devices"]]
        groups.append(("cpu", host["cpu"]["workers"], None))
        for name, workers, gpu in groups:
            alive.add_metric([host["host"], name], sum(1 for w in workers if w["state"] in ("idle", "busy")))
            if gpu is not None and gpu["memory_total"] is not None:  # not a GPU NVML could not read
                used.add_metric([host["host"], name, gpu["uuid"] or ""], gpu["memory_used"])
                total.add_metric([host["host"], name, gpu["uuid"] or ""], gpu["memory_total"])
            for w in workers:
                torch_stats = w.get("torch") or {}
                if torch_stats.get("memory_allocated") is not None:
                    allocated.add_metric([host["host"], name, w["id"]], torch_stats["memory_allocated"])
                if torch_stats.get("memory_reserved") is not None:
                    reserved.add_metric([host["host"], name, w["id"]], torch_stats["memory_reserved"])
    yield from (alive, used, total, allocated, reserved)


def registry(engine: Engine, stale_after_s: float, node: str | None = None) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(engine, stale_after_s, node))
    return reg


def render(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)
