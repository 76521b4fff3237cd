"""Prometheus metrics: what happened to jobs (counters, the duration histogram) and how things stand (the
queue, sweeps, the workers and the devices), read fresh from the shared database at every scrape.

Nothing is counted in the server's memory: with several servers (or a restart) every scrape of any
server tells the same story. Counters and the histogram are the counters table, added to in the
transaction of each event (app/db/counting.py), so they only ever go up whatever happens to the jobs'
rows; gauges are read from the current rows (app/observe/gauges.py).

What a scrape shows depends on who asks: an admin (or a server without accounts) gets everything; a user
gets the gauges of their project's rows and the fleet's worker and device gauges (no job ids in those),
but no counters, the duration histogram or the store's gauges: those are not kept per project.
"""
import itertools
import math
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from sqlalchemy.engine import Engine

from trainyard.app.accounts import Principal
from trainyard.app.core.states import Failure
from trainyard.app.db import counting, read
from trainyard.app.fleet import devices_payload
from trainyard.app.lifecycle import collector
from trainyard.app.observe import gauges
from trainyard.app.spec import JOB_KINDS

Series = list[tuple[str, dict[str, str], float]]
# The kinds of object the collector removes from the store (a host's cache is evicted, not collected).
STORED_KINDS = tuple(k for k in collector.KINDS if k != "cache")

# Each counter: its help, and its labels with the values known beforehand (shown at 0 until counted, so
# that rate() sees the first event); a value counted beyond them (an older release's state) is shown too.
COUNTERS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    counting.SUBMITTED: ("Jobs submitted (sweeps' trials included)", {"kind": JOB_KINDS}),
    counting.FINISHED: ("Jobs that reached an end state", {"kind": JOB_KINDS, "state": counting.ENDINGS}),
    counting.FAILURES: ("Errors recorded in jobs' histories by class: failed runs, retried or not, cancels, prunes",
                        {"class": tuple(f.value for f in Failure)}),
    counting.RETRIES: ("Jobs put back in the queue under their id: on request (POST /jobs/{id}/retry) or after a "
                       "retryable failure", {"trigger": tuple(t.value for t in counting.Trigger)}),
    counting.PREEMPTIONS: ("Running jobs put back in the queue by their worker's shutdown", {}),
    counting.LEASE_EXPIRIES: ("Running jobs whose worker stopped renewing their lease (lost workers)", {}),
    counting.COLLECTED: ("Stored objects the collector removed because no row referenced them any more (after the "
                         "retention rules let go of them, or left by a crash)", {"kind": STORED_KINDS}),
    counting.COLLECTED_BYTES: ("Bytes of the stored objects the collector removed", {"kind": STORED_KINDS}),
    counting.COLLECTIONS: ("Passes of the collector (every TRAINYARD_COLLECT_S, and POST /storage/collect)", {}),
    counting.TRACKER_SENDS: ("Jobs' and sweeps' runs brought up to date in an experiment tracker",
                             {"tracker": ("mlflow",)}),
    counting.TRACKER_ERRORS: ("Sends to an experiment tracker that failed (sent again later)",
                              {"tracker": ("mlflow",)}),
}
DURATION_LABELS = {"kind": JOB_KINDS, "state": counting.ENDINGS}


class _Collector:
    def __init__(self, engine: Engine, stale_after_s: float, node: str | None = None, who: Principal | None = None):
        self.engine = engine
        self.stale_after_s = stale_after_s
        self.node = node
        self.who = who

    def collect(self) -> Iterator[Metric]:
        if self.who is None or self.who.admin:
            with read(self.engine) as conn:
                series = list(counting.read(conn))
            yield from counter_families(series)
        yield from gauges.families(gauges.read_rows(self.engine, self.stale_after_s, self.who))
        yield from _device_families(devices_payload.snapshot(self.engine, self.stale_after_s, self.node))


def _known(labels: dict[str, tuple[str, ...]]) -> Iterable[tuple[str, ...]]:
    return itertools.product(*labels.values())


def counter_families(series: Series) -> Iterator[Metric]:
    """The counters and the job-duration histogram from the counters table's rows."""
    for name, (help_, labels) in COUNTERS.items():
        values = dict.fromkeys(_known(labels), 0.0)
        for stored, got, value in series:
            if stored == name:
                key = tuple(got.get(label, "") for label in labels)
                values[key] = values.get(key, 0.0) + value
        family = CounterMetricFamily(name, help_, labels=list(labels))
        for key, value in sorted(values.items()):
            family.add_metric(list(key), value)
        yield family
    yield _durations(series)


def _durations(series: Series) -> Metric:
    """Stored as each bucket's own count (app/db/counting.py); shown cumulative, as Prometheus reads buckets."""
    names = list(DURATION_LABELS)
    counts: dict[tuple[str, ...], dict[float, float]] = {key: {} for key in _known(DURATION_LABELS)}
    sums: dict[tuple[str, ...], float] = {}
    for name, got, value in series:
        key = tuple(got.get(label, "") for label in names)
        if name == counting.DURATION:
            bucket = counts.setdefault(key, {})
            le = float(got["le"])
            bucket[le] = bucket.get(le, 0.0) + value
        elif name == counting.DURATION_SUM:
            sums[key] = sums.get(key, 0.0) + value
    hist = HistogramMetricFamily(counting.DURATION, "Run time of jobs that ended while running (their last run), "
                                 "by how they ended", labels=names)
    for key, bucket in sorted(counts.items()):
        running, cumulative = 0.0, []
        for le in sorted(set(counting.BUCKETS) | set(bucket)):
            running += bucket.get(le, 0.0)
            cumulative.append(("+Inf" if math.isinf(le) else repr(le), running))
        hist.add_metric(list(key), cumulative, sums.get(key, 0.0))
    return hist


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


def registry(engine: Engine, stale_after_s: float, node: str | None = None,
             who: Principal | None = None) -> CollectorRegistry:
    """What /metrics renders for `who` (None: everything, as an admin sees it)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(engine, stale_after_s, node, who))
    return reg


def render(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)
