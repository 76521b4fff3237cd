"""Priority preemption (app/fleet/preemption.py): the choice on both databases (the minimum run time, an idle worker,
never a job of the same priority and project, a project under its share taking a device from one over it), and
over HTTP with a real worker: a priority-10 job starts within the grace period + 2 s by preempting a running
job, which checkpoints, is requeued without using an attempt and ends with the weights of an uninterrupted run."""
import time

import pytest
from safetensors.torch import load
from sqlalchemy import select, update

from tests.helpers.backends import BACKENDS, fresh_database
from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.service import FAST_ENV, Service
from trainyard.app import accounts
from trainyard.app.accounts import audit
from trainyard.app.core.settings import Settings
from trainyard.app.db import jobs, read, write
from trainyard.app.fleet import preemption, workers
from trainyard.app.jobs import queue
from trainyard.app.jobs.submit import enqueue
from trainyard.app.spec import parse_spec

SETTINGS = Settings(preempt_min_run_s=60, lease_s=30)


def queued(engine, priority: int = 0, project_id: int | None = None) -> int:
    job_id = enqueue(engine, parse_spec({**tiny_job(), "priority": priority}))[0].id
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(project_id=project_id))
    return job_id


def running(engine, worker: str, ran_s: float, priority: int = 0, project_id: int | None = None) -> tuple[int, int]:
    """A job claimed by `worker` that has run ran_s seconds: (id, claim)."""
    job_id = queued(engine, priority, project_id)
    job = queue.claim(engine, worker, "cpu", 30)
    assert job is not None and job.id == job_id
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(started_at=time.time() - ran_s))
    return job_id, job.claim


def test_a_run_younger_than_the_minimum_or_beside_an_idle_worker_is_not_preempted(engine):
    low, claim = running(engine, "w1", ran_s=10)
    high = queued(engine, priority=10)
    assert preemption.choose(engine, SETTINGS) == []  # ran 10 s of its 60
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == low).values(started_at=time.time() - 120))
    assert preemption.choose(engine, SETTINGS) == [(low, claim, high)]
    workers.register_worker(engine, "w2", "h", 1, "cpu", {})  # idle: it takes the job, nobody is preempted
    assert preemption.choose(engine, SETTINGS) == []
    workers.worker_heartbeat(engine, "w2", "busy", None)
    assert preemption.fence(engine, low, claim) == "ours"
    assert not preemption.request(engine, low, claim, low)  # not for a job that is not queued
    assert preemption.request(engine, low, claim, high)
    assert not preemption.request(engine, low, claim, high)  # asked once
    assert preemption.choose(engine, SETTINGS) == []  # one under way for the device class
    assert preemption.fence(engine, low, claim) == "preempt"
    [entry] = audit.entries(engine, action="preempt")
    assert (entry["actor"], entry["target"], entry["detail"]) == ("admin", f"job {low}", {"for": high})
    assert queue.requeue_preempted(engine, low, claim)
    with read(engine) as conn:
        row = conn.execute(select(jobs.c.state, jobs.c.attempt, jobs.c.preempt_requested_at)
                           .where(jobs.c.id == low)).one()
    assert tuple(row) == ("queued", 0, None)
    assert preemption.fence(engine, low, claim) == "lost"


def test_never_the_same_priority_within_a_project_but_a_project_under_its_share_may(engine):
    alpha = accounts.add_project(engine, "alpha")["id"]
    beta = accounts.add_project(engine, "beta")["id"]
    # alpha ran a job for 600 s that ended 5 minutes ago, and runs another now: all the device time so far.
    earlier, _ = running(engine, "w0", ran_s=900, project_id=alpha)
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == earlier).values(state="succeeded",
                                                                     finished_at=time.time() - 300))
    victim, claim = running(engine, "w1", ran_s=1000, project_id=alpha)
    queued(engine, project_id=alpha)
    assert preemption.choose(engine, SETTINGS) == []  # same priority, same project
    queued(engine, priority=-5, project_id=alpha)
    assert preemption.choose(engine, SETTINGS) == []  # lower priority
    # beta has had no device time (under its share), alpha all of it (over): beta's job is the head, and
    # takes the device although of the same priority. (Only alpha's ended run decides it: the victim's own run
    # stops counting once it is requeued, so without the earlier one the two projects would tie at nothing and
    # the claim would hand the device straight back to the victim, which is no reason to preempt.)
    for_beta = queued(engine, project_id=beta)
    assert preemption.choose(engine, SETTINGS) == [(victim, claim, for_beta)]


@pytest.fixture(params=BACKENDS)
def one_worker(request, tmp_path):
    """The real server and one CPU worker, preempting runs of a second or more, on each database."""
    with fresh_database(request.param, "pre") as url:
        svc = Service(tmp_path / "data", url, env={"TRAINYARD_PREEMPT_MIN_RUN_S": "1"})
        try:
            svc.start_server()
            svc.start_worker("cpu")
            yield svc
        finally:
            svc.stop()


@pytest.mark.slow
def test_a_high_priority_job_preempts_and_the_victim_resumes_exactly(one_worker):
    svc, grace_s = one_worker, float(FAST_ENV["TRAINYARD_GRACE_S"])
    # 100 epochs: about 6 s on a fast 2-core machine, well past the ~1.5 s a preemption takes (at 20, the 1.3 s run
    # could end before its preemption did, and a fresh clone's run failed on it).
    spec = slow_job(epochs=100, seed=7)
    alone = svc.wait_state(svc.submit(spec)["id"], timeout=240)
    assert alone["state"] == "succeeded"
    victim = svc.submit(spec)["id"]
    svc.wait_until(lambda: (svc.job(victim)["checkpoint_epoch"] or 0) >= 2, 120, "the victim to checkpoint")
    t0 = time.monotonic()
    high = svc.submit({**slow_job(epochs=3), "priority": 10})["id"]  # runs long enough to see the victim wait
    while svc.job(high)["state"] == "queued":
        assert time.monotonic() - t0 < grace_s + 2, "the high-priority job did not start in time"
        time.sleep(0.05)
    latency = time.monotonic() - t0
    print(f"preemption latency: {latency:.2f} s")
    back = svc.job(victim)
    assert back["state"] == "queued" and back["attempt"] == 0 and back["runs"] == 1, back
    assert svc.wait_state(high, timeout=60)["state"] == "succeeded"
    done = svc.wait_state(victim, timeout=240)
    assert done["state"] == "succeeded" and done["attempt"] == 1 and done["runs"] == 2, done
    assert done["result"]["resumed_from_epoch"] is not None
    with svc.client() as c:
        assert "preempted for a job of higher priority" in c.get(f"/jobs/{victim}/logs").text
        [entry] = c.get("/admin/audit", params={"action": "preempt"}).json()
        assert entry["target"] == f"job {victim}" and entry["detail"] == {"for": high}
        want = load(c.get(f"/jobs/{alone['id']}/artifact").content)
        got = load(c.get(f"/jobs/{victim}/artifact").content)
    assert want.keys() == got.keys() and all(want[k].equal(got[k]) for k in want)
