"""Fair share between projects and their device limits at the claim (app/fleet/fair_share.py,
app/fleet/placement.py), on
both databases: the project with the least recent device time for its share is served first, whatever the
priorities and ages of other projects' jobs; device time fades by half each half-life; a project at its
`devices` or `gpu_memory_gb` limit is skipped and its jobs say why."""
import time

from sqlalchemy import select, update

from tests.helpers.jobs import tiny_job
from trainyard.app import accounts
from trainyard.app.db import jobs, read, write
from trainyard.app.fleet import fair_share, placement
from trainyard.app.jobs import queue
from trainyard.app.jobs.submit import enqueue
from trainyard.app.records.job_reads import get_job
from trainyard.app.spec import parse_spec

HOUR = 3600.0


def queued(engine, project_id: int | None, priority: int = 0, **over) -> int:
    job_id = enqueue(engine, parse_spec({**tiny_job(), "priority": priority, **over}))[0].id
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(project_id=project_id))
    return job_id


def ran(engine, project_id: int, seconds: float, ended_ago: float | None = None, devices: int = 1) -> None:
    """A job of the project that ran `seconds` on `devices`, ending `ended_ago` seconds ago (None: still runs)."""
    job_id = queued(engine, project_id)
    now = time.time()
    end = None if ended_ago is None else now - ended_ago
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(
            state="running" if end is None else "succeeded", devices=devices,
            started_at=(end or now) - seconds, finished_at=end))


def two_projects(engine) -> tuple[int, int]:
    return accounts.add_project(engine, "alpha")["id"], accounts.add_project(engine, "beta")["id"]


def test_the_project_under_its_share_is_served_first(engine):
    alpha, beta = two_projects(engine)
    ran(engine, alpha, 600, ended_ago=60)
    first = queued(engine, alpha, priority=10)  # older and higher priority, but alpha has had the device
    second = queued(engine, beta)
    assert queue.claim(engine, "w1", "cpu", 30).id == second
    assert queue.claim(engine, "w2", "cpu", 30).id == first


def test_shares_weigh_device_time_and_it_fades_by_half_each_half_life(engine):
    alpha, beta = two_projects(engine)
    accounts.set_project(engine, "alpha", share=4.0)
    ran(engine, alpha, 1000, ended_ago=0)   # 1000 / 4 = 250
    ran(engine, beta, 400, ended_ago=0)     # 400 / 1
    a, b = queued(engine, alpha), queued(engine, beta)
    assert queue.claim(engine, "w1", "cpu", 30).id == a
    with read(engine) as conn:
        used, _ = fair_share.usage(conn, HOUR)
    assert abs(used[beta] - 400) < 5
    ran(engine, beta, 800, ended_ago=2 * HOUR)  # counts 200 now
    with read(engine) as conn:
        used, _ = fair_share.usage(conn, HOUR)
    assert abs(used[beta] - 600) < 5
    assert queue.claim(engine, "w2", "cpu", 30).id == b


def test_a_project_alone_uses_every_device_and_one_at_its_limit_waits(engine):
    alpha, beta = two_projects(engine)
    accounts.set_project(engine, "alpha", limits={"devices": 1})
    a1, a2 = queued(engine, alpha), queued(engine, alpha)
    assert queue.claim(engine, "w1", "cpu", 30).id == a1
    assert queue.claim(engine, "w2", "cpu", 30) is None  # alpha holds its one device
    with read(engine) as conn:
        why = fair_share.at_limit(conn, [get_job(engine, a2)])
    assert "project alpha is at its limit of 1 device in use at once" in why[a2]
    b1, b2 = queued(engine, beta), queued(engine, beta)
    assert {queue.claim(engine, "w2", "cpu", 30).id, queue.claim(engine, "w3", "cpu", 30).id} == {b1, b2}
    queue.succeed(engine, a1, 1, {}, None)
    assert queue.claim(engine, "w1", "cpu", 30).id == a2


def gpu_job(engine, project_id: int, gb: float | None, **over) -> int:
    if gb:
        over["resources"] = {"gpu_memory_gb": gb}
    return queued(engine, project_id, device="auto", **over)


def test_a_project_at_its_gpu_memory_limit_waits_as_does_its_gpu_job_that_states_none(engine):
    alpha, beta = two_projects(engine)
    accounts.set_project(engine, "alpha", limits={"gpu_memory_gb": 30})
    gpu = placement.Slot("GPU-aaaa", budget=80 * 10**9)
    a1, a2, a3 = gpu_job(engine, alpha, 20), gpu_job(engine, alpha, 20), gpu_job(engine, alpha, 10)
    whole, wide = gpu_job(engine, alpha, None), gpu_job(engine, alpha, None, devices=2)
    on_cpu = queued(engine, alpha, device="cpu")
    assert queue.claim(engine, "w1", "cuda:0", 30, None, gpu).id == a1
    assert queue.claim(engine, "w2", "cuda:0", 30, None, gpu).id == a3   # 20 + 20 > 30 GB: a2 waits, 10 fits
    assert queue.claim(engine, "w3", "cuda:0", 30, None, gpu) is None    # a2 over it, whole and wide state none
    with read(engine) as conn:
        why = fair_share.at_limit(conn, [get_job(engine, j) for j in (a2, whole, wide, on_cpu)])
    assert why[a2] == ("project alpha is at its limit of 30 GB of GPU memory in use at once (gpu_memory_gb): its "
                       "running jobs stated 30.0 GB, this one 20.0 GB")
    assert "a job that may run on a GPU must state resources.gpu_memory_gb" in why[whole]
    assert "a job on several GPUs takes them whole" in why[wide]
    assert on_cpu not in why
    # Another project is not held back by alpha's limit, nor is alpha's CPU job.
    b = gpu_job(engine, beta, 40)
    assert queue.claim(engine, "w4", "cuda:0", 30, None, gpu).id == b
    # A CPU worker's claim may take the job that states no memory (it runs on the CPU there), oldest first.
    assert queue.claim(engine, "w5", "cpu", 30).id == whole
    assert queue.claim(engine, "w6", "cpu", 30).id == on_cpu
    with read(engine) as conn:
        anywhere = set(conn.execute(select(jobs.c.id).where(jobs.c.state == "queued",
                                                            fair_share.limited(conn))).scalars())
        on_a_cpu = set(conn.execute(select(jobs.c.id).where(jobs.c.state == "queued",
                                                            fair_share.limited(conn, "cpu"))).scalars())
    assert wide not in anywhere and a2 not in anywhere and a2 not in on_a_cpu
    queue.succeed(engine, a1, 1, {}, None)
    assert queue.claim(engine, "w1", "cuda:0", 30, None, gpu).id == a2
