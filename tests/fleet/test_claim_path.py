"""The claim path's cost and guarantees (issue 40), on both databases: an idle worker's look at the queue costs one
statement when nothing changed since its last (app/fleet/idle_look.py), and loses no job queued around it; fair share
reads the jobs' history only when two or more projects compete, orders them when they do (the reading made by a
look used again by its claim), and leaves priority then age when one project competes."""
import time

from sqlalchemy import event, update

from tests.helpers.jobs import tiny_job
from trainyard.app import accounts
from trainyard.app.db import jobs, write
from trainyard.app.fleet import idle_look, workers
from trainyard.app.fleet.placement import Slot
from trainyard.app.jobs import queue
from trainyard.app.jobs.submit import enqueue
from trainyard.app.spec import parse_spec


def queued(engine, project_id: int | None = None, priority: int = 0, **over) -> int:
    job_id = enqueue(engine, parse_spec({**tiny_job(), "priority": priority, **over}))[0].id
    if project_id is not None:
        with write(engine) as conn:
            conn.execute(update(jobs).where(jobs.c.id == job_id).values(project_id=project_id))
    return job_id


def ran(engine, project_id: int, seconds: float) -> None:
    """A job of the project that ran `seconds` and ended a minute ago."""
    job_id = queued(engine, project_id)
    now = time.time()
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(
            state="succeeded", started_at=now - 60 - seconds, finished_at=now - 60))


class Sent:
    """The statements an engine sends (before_cursor_execute), but a transaction's BEGIN."""

    def __init__(self, engine, hook=None):
        self.texts: list[str] = []
        self.hook = hook
        event.listen(engine, "before_cursor_execute", self._seen)

    def _seen(self, conn, cursor, statement, *_):
        if statement.strip().upper() not in ("BEGIN", "BEGIN IMMEDIATE"):
            self.texts.append(statement)
            if self.hook is not None:
                self.hook(len(self.texts))

    def since(self, n: int) -> list[str]:
        return self.texts[n:]


def look(engine, poll: idle_look.Look, woken: bool = False, worker: str = "w1") -> bool:
    return queue.has_work(engine, "cpu", None, worker, Slot(worker), 30, look=poll, woken=woken)


def test_an_idle_look_when_nothing_changed_sends_one_statement(engine):
    workers.register_worker(engine, "w1", "h", 1, "cpu", {})
    alpha = accounts.add_project(engine, "alpha")["id"]
    for _ in range(20):
        ran(engine, alpha, 100)
    queued(engine, device="cuda")  # queued, but for another device
    sent, poll = Sent(engine), idle_look.Look()
    assert not look(engine, poll)  # the first look reads in full
    full = len(sent.texts)
    assert full > 1
    for _ in range(3):
        n = len(sent.texts)
        assert not look(engine, poll)
        assert len(sent.since(n)) == 1, sent.since(n)  # the mark, nothing more
    n = len(sent.texts)
    assert not look(engine, poll, woken=True)  # a wake-up always reads in full
    assert len(sent.since(n)) == full


def test_a_job_queued_while_a_look_reads_is_claimed_by_the_next_look(engine):
    """No wake-up is lost to the mark: a job queued after the look read its mark, while it was reading the queue
    (it may not see the job: SQLite reads one snapshot), moves the mark, and the next look (a safety-net poll,
    not woken) reads in full and finds it."""
    workers.register_worker(engine, "w1", "h", 1, "cpu", {})
    poll = idle_look.Look()
    assert not look(engine, poll)
    made = []
    sent = Sent(engine, hook=lambda k: made.append(queued(engine)) if k == base + 2 and not made else None)
    base = len(sent.texts)
    look(engine, poll, woken=True)  # its mark (statement base + 1), the job queued, the full read (base + 2)
    assert made and sent.texts[base].lstrip().upper().startswith("SELECT")
    assert look(engine, poll)
    job = queue.claim(engine, "w1", "cpu", 30, None, Slot("w1"), look=poll)
    assert job is not None and job.id == made[0]
    assert not look(engine, poll)  # after a claim: a full look, that finds nothing more


def test_what_no_counter_counts_is_seen_within_every_s(engine):
    """A project's limit raised changes no counter: the full look that comes every `every_s` finds its job."""
    workers.register_worker(engine, "w1", "h", 1, "cpu", {})
    workers.register_worker(engine, "w2", "h", 2, "cpu", {})
    alpha = accounts.add_project(engine, "alpha", limits={"devices": 1})["id"]
    first, second = queued(engine, alpha), queued(engine, alpha)
    assert queue.claim(engine, "w2", "cpu", 30, None, Slot("w2")).id == first
    poll = idle_look.Look(every_s=0.5)
    assert not look(engine, poll)  # alpha holds its one device
    accounts.set_project(engine, "alpha", limits={"devices": 2})
    t0 = time.monotonic()
    while not look(engine, poll):
        assert time.monotonic() - t0 < 5
        time.sleep(0.05)
    assert queue.claim(engine, "w1", "cpu", 30, None, Slot("w1"), look=poll).id == second


def test_one_project_competing_orders_by_priority_then_age_without_reading_history(engine):
    workers.register_worker(engine, "w1", "h", 1, "cpu", {})
    alpha, beta = accounts.add_project(engine, "alpha")["id"], accounts.add_project(engine, "beta")["id"]
    for p in (alpha, beta, alpha):
        ran(engine, p, 500)
    low, high, higher_later = queued(engine, alpha), queued(engine, alpha, 5), queued(engine, alpha, 5)
    queued(engine, beta, device="cuda")  # beta waits for another device: it does not compete here
    sent, poll, order = Sent(engine), idle_look.Look(), []
    while look(engine, poll, woken=True):
        order.append(queue.claim(engine, "w1", "cpu", 30, None, Slot("w1"), look=poll).id)
        with write(engine) as conn:
            conn.execute(update(jobs).where(jobs.c.id == order[-1]).values(state="succeeded", finished_at=0.0))
    assert order == [high, higher_later, low]
    assert not [s for s in sent.texts if "finished_at >" in s]  # no read of the jobs' history


def test_two_projects_competing_are_ordered_by_fair_share_the_look_reading_serving_its_claim(engine):
    workers.register_worker(engine, "w1", "h", 1, "cpu", {})
    alpha, beta = accounts.add_project(engine, "alpha")["id"], accounts.add_project(engine, "beta")["id"]
    ran(engine, alpha, 600)
    ran(engine, beta, 60)
    a = queued(engine, alpha, priority=10)  # older and higher priority, but alpha has had the device
    b = queued(engine, beta)
    sent, poll = Sent(engine), idle_look.Look()
    assert look(engine, poll, woken=True)
    reads = len([s for s in sent.texts if "finished_at >" in s])
    assert queue.claim(engine, "w1", "cpu", 30, None, Slot("w1"), look=poll).id == b
    assert len([s for s in sent.texts if "finished_at >" in s]) == reads == 1  # one reading for the cycle
    assert queue.claim(engine, "w2", "cpu", 30, None, Slot("w2")).id == a


def test_a_project_that_joins_between_look_and_claim_is_ranked_by_the_claim(engine):
    """The look saw one project (no reading); the claim sees two, and reads fair share itself."""
    workers.register_worker(engine, "w1", "h", 1, "cpu", {})
    alpha, beta = accounts.add_project(engine, "alpha")["id"], accounts.add_project(engine, "beta")["id"]
    ran(engine, alpha, 600)
    a = queued(engine, alpha, priority=10)
    poll = idle_look.Look()
    assert look(engine, poll, woken=True)
    b = queued(engine, beta)
    assert queue.claim(engine, "w1", "cpu", 30, None, Slot("w1"), look=poll).id == b
    assert queue.claim(engine, "w2", "cpu", 30, None, Slot("w2")).id == a
