"""Jobs across hosts: which host runs which of a job's ranks, where they meet, and whether every host is there.

A job spread over several hosts (`hosts: M`) is claimed by one worker like any multi-device job
(app/fleet/placement.py picks the other ranks' workers, app/jobs/queue.py records them in `ranks`). Rank 0's worker
runs the ranks of its own host and renews the lease; on every other host the first lent worker in rank
order (the host's *part leader*) runs that host's ranks (worker/supervisor/part.py), reading the job's fence. They
meet at rank 0's address (`master`). Rank 0's worker watches the part leaders' heartbeats: a host that
stops heartbeating for a lease ends the run as `infrastructure` (retried from its last checkpoint), long
before a collective would time out. Torch-free.
"""
from sqlalchemy import and_, select
from sqlalchemy.engine import Engine

from trainyard.app.core.states import JobState
from trainyard.app.db import db_now, jobs, read, workers
from trainyard.app.records import Job, Rank

RUNNING = JobState.RUNNING.value


def master(ranks: list[Rank] | None) -> str:
    """Where a job across hosts has its ranks meet ("addr:port", rank 0's); "" for a job on one host."""
    if not ranks:
        return ""
    first = ranks[0]
    return f"{first['addr']}:{first['port']}" if first.get("addr") and first.get("port") else ""


def ranks_on(ranks: list[Rank] | None, host: str) -> tuple[int, ...]:
    """The ranks (their indices) that run on `host`, in rank order."""
    return tuple(i for i, r in enumerate(ranks or []) if r.get("host") == host)


def describe(ranks: list[Rank] | None) -> str:
    """How a job's ranks lie over hosts, for its log: 'hostA: 0,1; hostB: 2,3, meeting at 10.0.0.1:4567'."""
    hosts = dict.fromkeys(r.get("host", "") for r in ranks or [])
    return "; ".join(f"{h}: {','.join(map(str, ranks_on(ranks, h)))}" for h in hosts) + f", meeting at {master(ranks)}"


def part_leaders(ranks: list[Rank] | None) -> dict[str, str]:
    """Each host but rank 0's: the worker that runs its ranks (the first of them in rank order)."""
    ranks = ranks or []
    leaders: dict[str, str] = {}
    for r in ranks[1:]:
        if r.get("host") != ranks[0].get("host"):
            leaders.setdefault(r["host"], r["worker"])
    return leaders


def part_to_run(engine: Engine, worker_id: str, host: str) -> Job | None:
    """The running job across hosts whose ranks on this host this worker leads, if any."""
    with read(engine) as conn:
        row = conn.execute(select(jobs).join(workers, and_(workers.c.lent_to == jobs.c.id,
                                                           workers.c.lent_claim == jobs.c.claim))
                           .where(workers.c.id == worker_id, jobs.c.state == RUNNING, jobs.c.hosts > 1)).first()
    if row is None:
        return None
    job = Job.from_row(row)
    return job if part_leaders(job.ranks).get(host) == worker_id else None


def lost_hosts(engine: Engine, job: Job, lease_s: float) -> list[str]:
    """The hosts of a job across hosts whose part leader has not heartbeaten for a lease, or has stopped:
    their ranks are gone (a host's worker killed, its network cut), and the job's collectives would wait."""
    leaders = part_leaders(job.ranks)
    if not leaders:
        return []
    with read(engine) as conn:
        alive = {w for (w,) in conn.execute(select(workers.c.id).where(
            workers.c.id.in_(list(leaders.values())), workers.c.state != "stopped",
            workers.c.last_heartbeat > db_now() - lease_s))}
    return sorted(f"{host} (worker {w})" for host, w in leaders.items() if w not in alive)
