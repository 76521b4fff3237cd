"""The queue's state machine, on SQLite and on the real PostgreSQL server, with the same code."""
import threading
import time

import pytest
from sqlalchemy import func, select

from tests.helpers.jobs import IRIS_JOB, enqueued
from trainyard.app.core import errors
from trainyard.app.db import make_engine, migrate
from trainyard.app.jobs import queue
from trainyard.app.jobs.submit import enqueue
from trainyard.app.records import job_reads
from trainyard.app.spec import parse_spec


def test_a_claim_in_progress_is_waited_for_not_skipped_past(engine):
    """While one worker's claim looks at a multi-device head it cannot start yet, another worker's claim
    waits for it and then sees that same head: it never skips the head (as row locks with SKIP LOCKED
    would let it) and overtakes it with a job submitted later."""
    from trainyard.app.db import jobs, write
    from trainyard.app.fleet import workers
    from trainyard.app.fleet.placement import Slot
    for w in ("a", "b"):
        workers.register_worker(engine, w, "h", 1, "cpu", {})
    wide = enqueued(engine, devices=2)
    after = enqueued(engine)
    took = {}
    with write(engine) as conn:  # worker a's claim, caught in the middle: it holds what a claim holds
        if conn.dialect.name == "postgresql":
            conn.execute(select(func.pg_advisory_xact_lock(queue.CLAIM_LOCK)))
        conn.execute(select(jobs.c.id).where(jobs.c.id == wide.id).with_for_update())
        b = threading.Thread(target=lambda: took.setdefault("b", queue.claim(engine, "b", "cpu", 10, None,
                                                                             Slot("b", None, gang=2))))
        b.start()
        b.join(0.5)
        assert b.is_alive()  # b waits for a's claim to end
    b.join(10)
    assert took["b"].id == wide.id and [r["worker"] for r in took["b"].ranks] == ["b", "a"]
    assert queue.claim(engine, "a", "cpu", 10, None, Slot("a", None, gang=2)) is None  # lent to the wide job
    assert job_reads.get_job(engine, after.id).state == "queued"


def test_claim_order_priority_then_oldest(engine):
    a = enqueued(engine)
    b = enqueued(engine, priority=5)
    c = enqueued(engine)
    order = [queue.claim(engine, "w", "cpu", 10).id for _ in range(3)]
    assert order == [b.id, a.id, c.id]
    assert queue.claim(engine, "w", "cpu", 10) is None


def test_a_draining_worker_claims_nothing_until_undrained(engine):
    from trainyard.app.fleet import workers
    job = enqueued(engine)
    for w in ("a", "b"):
        workers.register_worker(engine, w, "host", 1, "cpu", {})
    assert workers.set_draining(engine, "a", True)["draining"] is True
    assert not queue.has_work(engine, "cpu", None, "a") and queue.has_work(engine, "cpu", None, "b")
    assert queue.claim(engine, "a", "cpu", 10) is None
    assert workers.set_draining(engine, "a", False)["draining"] is False
    assert queue.claim(engine, "a", "cpu", 10).id == job.id
    with pytest.raises(errors.NotFound):
        workers.set_draining(engine, "nobody", True)
    workers.worker_heartbeat(engine, "b", "stopped", None)
    with pytest.raises(errors.Conflict):
        workers.set_draining(engine, "b", True)


def test_jobs_that_state_their_gpu_memory_share_a_device_within_its_budget(engine):
    """Three workers on one 10 GB device (one slot key); jobs placed in order, without backfill."""
    from trainyard.app.fleet.placement import Slot
    gpu = Slot("GPU-aaaa", budget=10 * 10**9)
    mem = dict(device="auto")
    too_big = enqueued(engine, **mem, resources={"gpu_memory_gb": 20})   # never fits here: skipped, not waited for
    a = enqueued(engine, **mem, resources={"gpu_memory_gb": 6})
    c = enqueued(engine, **mem, resources={"gpu_memory_gb": 3})
    b = enqueued(engine, **mem, resources={"gpu_memory_gb": 6})
    whole = enqueued(engine, **mem)                                       # states nothing: the device to itself
    claim = lambda w, slot=gpu: queue.claim(engine, w, "cuda:0", 10, None, slot)  # noqa: E731
    got_a, got_c = claim("w1"), claim("w2")
    assert (got_a.id, got_c.id) == (a.id, c.id) and got_a.gpu_key == "GPU-aaaa" and got_a.need_gpu_memory == 6 * 10**9
    assert claim("w3") is None and not queue.has_work(engine, "cuda:0", None, "w3", gpu)  # 6 + 3 + 6 > 10
    other = queue.claim(engine, "w4", "cuda:1", 10, None, Slot("GPU-bbbb", 10 * 10**9))  # another GPU: its own budget
    assert other.id == b.id
    assert queue.succeed(engine, a.id, got_a.claim, {}, None)
    assert claim("w1") is None  # the head is now the whole-device job: it waits for c to end
    assert queue.succeed(engine, c.id, got_c.claim, {}, None)
    got_whole = claim("w1")
    assert got_whole.id == whole.id and claim("w2") is None
    assert job_reads.get_job(engine, too_big.id).state == "queued"


def test_a_head_another_worker_is_reading_is_still_the_head(engine):
    """A row lock on the head (a multi-device job that cannot start yet), such as another worker's has_work
    read took for the length of its statement, does not make a claim look past it and start a later job
    first (with FOR UPDATE SKIP LOCKED in the head's query it did, under the full suite's load)."""
    from trainyard.app.db import jobs, write
    from trainyard.app.fleet import workers
    from trainyard.app.fleet.placement import Slot
    for w in ("a", "b"):
        workers.register_worker(engine, w, "h", 1, "cpu", {})
    small = enqueued(engine)
    wide = enqueued(engine, devices=2)
    after = enqueued(engine)
    assert queue.claim(engine, "a", "cpu", 10, None, Slot("a", None, gang=2)).id == small.id
    assert not queue.has_work(engine, "cpu", None, "b", Slot("b", None, gang=2))
    if engine.dialect.name == "postgresql":  # SQLite has no row locks: BEGIN IMMEDIATE serialises claims
        with write(engine) as conn:
            conn.execute(select(jobs.c.id).where(jobs.c.id == wide.id).with_for_update())
            assert queue.claim(engine, "b", "cpu", 10, None, Slot("b", None, gang=2)) is None
    assert queue.claim(engine, "b", "cpu", 10, None, Slot("b", None, gang=2)) is None
    assert job_reads.get_job(engine, after.id).state == "queued"


def test_a_multi_device_job_borrows_idle_workers_of_its_host_and_kind(engine):
    """Gang claim: one claim takes the job and lends it idle workers of the same host and kind; the lent
    workers claim nothing while that run lasts; a job on N devices waits, without backfill, until N are idle."""
    from trainyard.app.fleet import workers
    from trainyard.app.fleet.placement import Slot
    for w, host, device in (("a", "h1", "cpu"), ("b", "h1", "cpu"), ("c", "h1", "cpu"), ("g", "h1", "cuda:0"),
                            ("x", "h2", "cpu")):
        workers.register_worker(engine, w, host, 1, device, {})
    three = Slot("a", None, gang=3)
    small = enqueued(engine)
    wide = enqueued(engine, devices=3)
    after = enqueued(engine)
    busy = queue.claim(engine, "b", "cpu", 10, None, Slot("b", None, gang=3))
    assert busy.id == small.id and busy.ranks is None
    # The head is the 3-device job; b is busy, so a and c wait for it rather than taking `after`.
    assert not queue.has_work(engine, "cpu", None, "a", three)
    assert queue.claim(engine, "a", "cpu", 10, None, three) is None
    assert queue.claim(engine, "c", "cpu", 10, None, Slot("c", None, gang=3)) is None
    # A worker whose host has fewer such workers than the job needs is not held back by it.
    assert queue.claim(engine, "x", "cpu", 10, None, Slot("x", None, gang=1)).id == after.id
    assert queue.succeed(engine, small.id, busy.claim, {}, None)
    assert queue.has_work(engine, "cpu", None, "a", three)
    got = queue.claim(engine, "a", "cpu", 10, None, three)
    assert got.id == wide.id and got.devices == 3
    # Same host, same kind: not g (cuda), not x (h2).
    assert [(r["worker"], r["device"]) for r in got.ranks] == [("a", "cpu"), ("b", "cpu"), ("c", "cpu")]
    assert workers.lent_to(engine, "b") == wide.id and workers.lent_to(engine, "g") is None
    late = enqueued(engine)
    for w in ("b", "c"):  # lent: they claim nothing while the run lasts
        assert not queue.has_work(engine, "cpu", None, w, Slot(w, None, gang=3))
        assert queue.claim(engine, w, "cpu", 10, None, Slot(w, None, gang=3)) is None
    # The run ends (here: requeued by a lost lease would do too): the lend means nothing any more.
    assert queue.succeed(engine, wide.id, got.claim, {}, None)
    assert workers.lent_to(engine, "b") is None
    assert queue.claim(engine, "b", "cpu", 10, None, Slot("b", None, gang=3)).id == late.id


def test_a_multi_device_job_takes_distinct_idle_gpus_and_no_draining_worker(engine):
    from trainyard.app.fleet import workers
    from trainyard.app.fleet.placement import Slot
    for w, device, uuid in (("g0", "cuda:0", "GPU-0"), ("g0b", "cuda:0", "GPU-0"), ("g1", "cuda:1", "GPU-1"),
                            ("g2", "cuda:2", "GPU-2")):
        workers.register_worker(engine, w, "h", 1, device, {"slot": {"key": uuid}})
    job = enqueued(engine, device="cuda", devices=2)
    workers.set_draining(engine, "g1", True)
    got = queue.claim(engine, "g0", "cuda:0", 10, None, Slot("GPU-0", None, gang=4))
    # g0b shares g0's GPU (a second rank there would only contend for it); g1 is draining.
    assert got.id == job.id
    assert [(r["worker"], r["device"]) for r in got.ranks] == [("g0", "cuda:0"), ("g2", "cuda:2")]
    # GPU-2 is a rank of that job now: a worker sharing it (g2b) starts nothing there until the job ends.
    workers.register_worker(engine, "g2b", "h", 1, "cuda:2", {"slot": {"key": "GPU-2"}})
    small = enqueued(engine, device="cuda")
    assert queue.claim(engine, "g2b", "cuda:2", 10, None, Slot("GPU-2", None, gang=5)) is None
    assert queue.succeed(engine, job.id, got.claim, {}, None)
    assert queue.claim(engine, "g2b", "cuda:2", 10, None, Slot("GPU-2", None, gang=5)).id == small.id


def test_a_worker_that_offers_no_device_memory_takes_no_job_that_states_some(engine):
    from trainyard.app.fleet.placement import Slot
    job = enqueued(engine, device="auto", resources={"gpu_memory_gb": 1})
    assert queue.claim(engine, "w", "cuda:0", 10) is None
    assert queue.claim(engine, "w", "cpu", 10, None, Slot("w", None)) is None
    assert queue.claim(engine, "w", "cpu", 10, None, Slot("host/cpu", 2 * 10**9)).id == job.id


def test_claim_respects_device(engine):
    gpu_only = enqueued(engine, device="cuda:1")
    anywhere = enqueued(engine, device="auto")
    assert queue.claim(engine, "w", "cpu", 10).id == anywhere.id
    assert queue.claim(engine, "w", "cpu", 10) is None
    assert queue.claim(engine, "w", "cuda:0", 10) is None
    got = queue.claim(engine, "w", "cuda:1", 10)
    assert got.id == gpu_only.id and got.device == "cuda:1"


def test_fenced_writes_of_a_stale_claim_change_nothing(engine):
    job = enqueued(engine)
    first = queue.claim(engine, "w1", "cpu", 0.01)
    time.sleep(0.05)
    assert queue.requeue_expired(engine) == [(job.id, "queued")]
    second = queue.claim(engine, "w2", "cpu", 10)
    assert second.claim == first.claim + 1 and second.attempt == 2
    # The first worker wakes up and tries to report: every write is refused.
    assert not queue.renew(engine, job.id, first.claim, 10)
    assert job_reads.claimed_since(engine, job.id, first.claim)  # nor may it publish its log over the second's
    assert not queue.record_epoch(engine, job.id, first.claim, 1, {"train_loss": 9.0})
    assert not queue.record_checkpoint(engine, job.id, first.claim, 1, "x")
    assert not queue.succeed(engine, job.id, first.claim, {"val_accuracy": 0.0}, "bogus")
    assert queue.fail(engine, job.id, first.claim, {"class": "job", "type": "E", "message": "m"}) is None
    assert queue.record_epoch(engine, job.id, second.claim, 1, {"train_loss": 1.0})
    assert queue.succeed(engine, job.id, second.claim, {"val_accuracy": 1.0}, "art")
    final = job_reads.get_job(engine, job.id)
    assert final.state == "succeeded" and final.artifact_path == "art"
    assert not job_reads.claimed_since(engine, job.id, second.claim)  # ended by it, claimed by no one since
    assert job_reads.get_metrics(engine, job.id) == [{"epoch": 1, "attempt": 2, "train_loss": 1.0}]


def test_expired_lease_fails_after_max_attempts(engine):
    job = enqueued(engine, max_attempts=2)
    for expected in ("queued", "failed"):
        queue.claim(engine, "w", "cpu", 0.01)
        time.sleep(0.05)
        assert queue.requeue_expired(engine) == [(job.id, expected)]
    final = job_reads.get_job(engine, job.id)
    assert final.error["class"] == "infrastructure" and "gave up after 2 attempts" in final.error["message"]
    assert [e["attempt"] for e in final.errors] == [1, 2]


def test_job_errors_are_not_retried_but_infrastructure_errors_are(engine):
    a, b = enqueued(engine), enqueued(engine)
    ca = queue.claim(engine, "w", "cpu", 10)
    assert queue.fail(engine, a.id, ca.claim, {"class": "job", "type": "ValueError", "message": "bad"}) == "failed"
    cb = queue.claim(engine, "w", "cpu", 10)
    assert queue.fail(engine, b.id, cb.claim, {"class": "infrastructure", "type": "X", "message": "m"}) == "queued"


def test_preempted_job_keeps_its_attempt_count(engine):
    job = enqueued(engine)
    c = queue.claim(engine, "w", "cpu", 10)
    assert c.attempt == 1
    assert queue.requeue_preempted(engine, job.id, c.claim)
    back = job_reads.get_job(engine, job.id)
    assert back.state == "queued" and back.attempt == 0


def test_resume_drops_metrics_after_the_checkpoint(engine):
    job = enqueued(engine)
    c = queue.claim(engine, "w", "cpu", 10)
    for epoch in (1, 2, 3):
        queue.record_epoch(engine, job.id, c.claim, epoch, {"train_loss": float(epoch)})
    queue.record_checkpoint(engine, job.id, c.claim, 2, "checkpoints/1/run-1.pt")
    queue.fail(engine, job.id, c.claim, {"class": "infrastructure", "type": "X", "message": "m"})
    again = queue.claim(engine, "w2", "cpu", 10)
    assert again.checkpoint_path == "checkpoints/1/run-1.pt" and again.epoch == 2
    assert [m["epoch"] for m in job_reads.get_metrics(engine, job.id)] == [1, 2]


def test_cancel_and_retry(engine):
    job = enqueued(engine)
    assert queue.cancel(engine, job.id).state == "cancelled"
    with pytest.raises(errors.Conflict):
        queue.cancel(engine, job.id)
    again = queue.retry(engine, job.id)
    assert again.state == "queued" and again.errors[0]["class"] == "cancelled"
    with pytest.raises(errors.Conflict):
        queue.retry(engine, job.id)
    with pytest.raises(errors.NotFound):
        queue.cancel(engine, 999)


def test_idempotency_key(engine):
    a, created_a = enqueue(engine, parse_spec(IRIS_JOB), "key-1")
    b, created_b = enqueue(engine, parse_spec(IRIS_JOB), "key-1")
    assert created_a and not created_b and a.id == b.id
    with pytest.raises(errors.Conflict):
        enqueue(engine, parse_spec({**IRIS_JOB, "name": "other"}), "key-1")
    assert job_reads.list_jobs(engine)[1] == 1


def test_concurrent_claims_never_share_a_job(backend_url: str) -> None:
    """Four workers, each with its own engine (as separate processes would have), drain 60 jobs."""
    setup = make_engine(backend_url)
    migrate.upgrade(setup)
    ids = {enqueued(setup).id for _ in range(60)}
    claimed: list[int] = []
    lock = threading.Lock()

    def drain(name):
        e = make_engine(backend_url)
        while (job := queue.claim(e, name, "cpu", 10)) is not None:
            assert queue.succeed(e, job.id, job.claim, {}, None)
            with lock:
                claimed.append(job.id)
        e.dispose()

    threads = [threading.Thread(target=drain, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == sorted(ids)
    rows, _ = job_reads.list_jobs(setup, limit=500)
    assert all(r.state == "succeeded" and r.claim == 1 for r in rows)
    setup.dispose()
