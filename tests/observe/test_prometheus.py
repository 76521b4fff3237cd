"""Prometheus metrics that alert right: every exposition parses (prometheus_client's own parser), counters and
the duration histogram only go up across retries, cancels and deletions (they are kept in the database
with the events they count, app/db/counting.py), and the gauges say what an operator alerts on: the queue
by device and reason class, the oldest queued job's age, workers' heartbeat age."""
import time

import pytest
from sqlalchemy import delete, update

from tests.helpers.backends import on_both_backends
from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.prometheus import Samples, parse, value
from trainyard.app.core.states import Failure, error_record
from trainyard.app.db import jobs, write
from trainyard.app.fleet import workers as registry
from trainyard.app.jobs import queue, submit
from trainyard.app.observe import prometheus
from trainyard.app.spec import parse_spec

service_backend = on_both_backends()

FAILING = {**tiny_job(), "model": {"arch": "cifar_net"}}  # iris rows are not 3x32x32 images


def cumulative(types: dict[str, str], samples: Samples) -> Samples:
    """The samples of counters and histograms: what must never go down."""
    return {k: v for k, v in samples.items()
            if types[k[0].removesuffix("_total").removesuffix("_bucket").removesuffix("_count")
                     .removesuffix("_sum")] in ("counter", "histogram")}


def assert_only_up(before: Samples, after: Samples) -> None:
    gone = set(before) - set(after)
    assert not gone, f"series vanished: {gone}"
    down = {k: (before[k], after[k]) for k in before if after[k] < before[k]}
    assert not down, f"went down: {down}"


def scrape(service) -> tuple[dict[str, str], Samples]:
    with service.client() as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def iris_like_csv() -> bytes:
    rows = ["a,b,label"] + [f"{i % 7 * 0.5},{(i % 5) * 0.25 + (i % 2) * 3},{'x' if i % 2 else 'y'}" for i in range(80)]
    return ("\n".join(rows) + "\n").encode()


@pytest.mark.slow
def test_the_exposition_parsed_before_and_after_retries(service):
    """The issue's case: a job's retry took its run out of trainyard_job_duration_seconds_count (78 -> 77 -> 78)."""
    service.start_worker("cpu")
    good = service.wait_state(service.submit(tiny_job())["id"])
    bad = service.wait_state(service.submit(FAILING)["id"])
    assert (good["state"], bad["state"]) == ("succeeded", "failed")
    types, first = scrape(service)
    assert types["trainyard_job_duration_seconds"] == "histogram"
    assert {types[n] for n in ("trainyard_jobs_submitted", "trainyard_jobs_finished", "trainyard_job_failures",
                               "trainyard_job_retries", "trainyard_job_lease_expiries")} == {"counter"}
    for state in ("succeeded", "failed"):
        assert value(first, "trainyard_job_duration_seconds_count", kind="train", state=state) == 1
        assert value(first, "trainyard_jobs_finished_total", kind="train", state=state) == 1
    assert value(first, "trainyard_jobs_submitted_total", kind="train") == 2
    assert value(first, "trainyard_job_failures_total", **{"class": "job"}) == 1
    assert value(first, "trainyard_job_retries_total", trigger="request") == 0  # shown before the first

    scrapes = [cumulative(types, first)]
    with service.client() as c:
        assert c.post(f"/jobs/{bad['id']}/retry").status_code == 200
    scrapes.append(cumulative(*scrape(service)))  # queued or running again: its earlier run still counts
    assert service.wait_state(bad["id"])["state"] == "failed"
    types, after = scrape(service)
    scrapes.append(cumulative(types, after))
    assert value(after, "trainyard_job_duration_seconds_count", kind="train", state="failed") == 2
    assert value(after, "trainyard_job_failures_total", **{"class": "job"}) == 2
    assert value(after, "trainyard_job_retries_total", trigger="request") == 1
    assert value(after, "trainyard_jobs_submitted_total", kind="train") == 2  # a retry is no new job

    # Cancels: a queued job (no duration: it never ran) and a running one (its run is observed).
    waiting = service.submit({**tiny_job(), "device": "cuda:5"})  # no worker serves it
    types, queued = scrape(service)
    assert value(queued, "trainyard_queue_depth", device="cuda:5", reason="no_device_worker") == 1
    assert 0 <= value(queued, "trainyard_queue_oldest_job_age_seconds", device="cuda:5",
                      reason="no_device_worker") < 60
    running = service.submit(slow_job())
    service.wait_state(running["id"], "running")
    with service.client() as c:
        assert c.post(f"/jobs/{waiting['id']}/cancel").status_code == 200
        assert c.post(f"/jobs/{running['id']}/cancel").status_code == 200
        scrapes.append(cumulative(*scrape(service)))
        assert c.post(f"/jobs/{waiting['id']}/retry").status_code == 200  # cancelled jobs retry too
        assert c.post(f"/jobs/{waiting['id']}/cancel").status_code == 200
    types, end = scrape(service)
    scrapes.append(cumulative(types, end))
    assert value(end, "trainyard_jobs_finished_total", kind="train", state="cancelled") == 3
    assert value(end, "trainyard_job_failures_total", **{"class": "cancelled"}) == 3
    assert value(end, "trainyard_job_duration_seconds_count", kind="train", state="cancelled") == 1
    assert value(end, "trainyard_job_retries_total", trigger="request") == 2
    assert not any(k[0] == "trainyard_queue_depth" for k in end)  # nothing queued: no series
    worker_age = [v for (name, _), v in end.items() if name == "trainyard_worker_heartbeat_age_seconds"]
    assert len(worker_age) == 1 and 0 <= worker_age[0] < 10  # heartbeats every 0.5 s in the tests

    # Deleting an uploaded dataset a finished job trained on moves no series of any kind.
    with service.client() as c:
        r = c.post("/datasets", files={"file": ("xy.csv", iris_like_csv())}, data={"label_column": "label"})
        assert r.status_code == 201, r.text
        data = {**tiny_job()["data"], "dataset": r.json()["dataset"]}
        assert service.wait_state(service.submit({**tiny_job(), "data": data})["id"])["state"] == "succeeded"
        types, before = scrape(service)
        assert c.delete(f"/datasets/{r.json()['id']}").status_code == 204
    types, deleted = scrape(service)
    scrapes.append(cumulative(types, deleted))
    assert {k: v for k, v in deleted.items() if "age_seconds" not in k[0]} == \
        {k: v for k, v in before.items() if "age_seconds" not in k[0]}
    for earlier, later in zip(scrapes, scrapes[1:]):
        assert_only_up(earlier, later)


SPEC = {"kind": "train", "model": {"arch": "mlp"}, "data": {"dataset": "iris"}, "train": {"epochs": 1}, "device": "cpu"}


def render(engine) -> tuple[dict[str, str], Samples]:
    return parse(prometheus.render(prometheus.registry(engine, stale_after_s=30)).decode())


def test_counters_outlive_the_rows_they_counted_and_count_lost_leases(engine):
    """Counted in the event's transaction, not recounted from rows: deleting every job (a coming DELETE
    /jobs/{id}) leaves the counters as they were; a lease expiry and a preemption are counted once each."""
    job, _ = submit.enqueue(engine, parse_spec(SPEC))
    claimed = queue.claim(engine, "w1", "cpu", lease_s=0.01)
    assert claimed is not None
    time.sleep(0.05)
    assert queue.requeue_expired(engine) == [(job.id, "queued")]
    assert queue.requeue_expired(engine) == []  # requeued once: counted once
    claimed = queue.claim(engine, "w1", "cpu", lease_s=30)
    assert claimed is not None and queue.requeue_preempted(engine, claimed.id, claimed.claim)
    assert not queue.requeue_preempted(engine, claimed.id, claimed.claim)  # fenced out: not counted
    claimed = queue.claim(engine, "w1", "cpu", lease_s=30)
    assert claimed is not None
    assert queue.fail(engine, claimed.id, claimed.claim, error_record(Failure.OOM, "OutOfMemoryError", "oom")) \
        == "failed"
    assert queue.fail(engine, claimed.id, claimed.claim, error_record(Failure.OOM, "X", "again")) is None
    types, counted = render(engine)
    expected = {("trainyard_job_lease_expiries_total", frozenset()): 1,
                ("trainyard_job_preemptions_total", frozenset()): 1,
                ("trainyard_job_retries_total", frozenset({("trigger", "failure")})): 1,
                ("trainyard_job_failures_total", frozenset({("class", "infrastructure")})): 1,
                ("trainyard_job_failures_total", frozenset({("class", "oom")})): 1,
                ("trainyard_jobs_finished_total", frozenset({("kind", "train"), ("state", "failed")})): 1,
                ("trainyard_job_duration_seconds_count", frozenset({("kind", "train"), ("state", "failed")})): 1}
    assert {k: counted[k] for k in expected} == expected
    with write(engine) as conn:
        conn.execute(delete(jobs))
    types, after = render(engine)
    assert cumulative(types, after) == cumulative(types, counted)
    assert value(after, "trainyard_jobs", kind="train", state="failed") == 0  # a gauge: from the rows


def test_the_queue_by_device_and_reason_class_and_its_oldest_age(engine):
    """The reason label is a class of app/fleet/waiting.py's answer (bounded), not its free text; a retried job's
    age counts from its retry, not from its submit."""
    cpu, _ = submit.enqueue(engine, parse_spec(SPEC))
    submit.enqueue(engine, parse_spec({**SPEC, "device": "cuda"}))
    _, st = render(engine)
    assert value(st, "trainyard_queue_depth", device="cpu", reason="no_worker") == 1
    assert value(st, "trainyard_queue_depth", device="cuda", reason="no_worker") == 1
    registry.register_worker(engine, "w1", "box", 1, "cpu", {})
    submit.enqueue(engine, parse_spec(SPEC))
    _, st = render(engine)
    assert value(st, "trainyard_queue_depth", device="cpu", reason="turn") == 2
    assert value(st, "trainyard_queue_depth", device="cuda", reason="no_device_worker") == 1
    assert 0 <= value(st, "trainyard_worker_heartbeat_age_seconds", worker="w1", host="box", device="cpu") < 60

    waits, _ = submit.enqueue(engine, parse_spec({**SPEC, "after": [cpu.id]}))  # waits for another job first
    _, st = render(engine)
    assert value(st, "trainyard_queue_depth", device="cpu", reason="dependency") == 1
    assert value(st, "trainyard_queue_depth", device="cpu", reason="turn") == 2
    # A job for Slurm waits for its allocation, not for a worker of the own fleet, idle w1 though there is.
    on_slurm, _ = submit.enqueue(engine, parse_spec({**SPEC, "runs_on": "slurm"}))
    _, st = render(engine)
    assert value(st, "trainyard_queue_depth", device="cpu", reason="slurm") == 1
    assert value(st, "trainyard_queue_depth", device="cpu", reason="turn") == 2
    with write(engine) as conn:
        conn.execute(delete(jobs).where(jobs.c.id.in_([waits.id, on_slurm.id])))

    claimed = queue.claim(engine, "w1", "cpu", lease_s=30)
    assert claimed is not None and claimed.id == cpu.id
    queue.fail(engine, claimed.id, claimed.claim, error_record(Failure.JOB, "X", "boom"))
    with write(engine) as conn:  # submitted a day ago
        conn.execute(update(jobs).values(created_at=jobs.c.created_at - 86400, queued_at=None))
    _, st = render(engine)
    assert value(st, "trainyard_queue_oldest_job_age_seconds", device="cpu", reason="turn") > 86000
    queue.retry(engine, cpu.id)
    with write(engine) as conn:  # the other cpu job leaves the queue
        conn.execute(delete(jobs).where(jobs.c.id != cpu.id, jobs.c.device_req == "cpu"))
    _, st = render(engine)
    assert value(st, "trainyard_queue_oldest_job_age_seconds", device="cpu", reason="turn") < 60

