"""The worker registry: workers register, heartbeat with their state and device stats, and are judged lost; one
whose lent device failed under another worker's job is taken out of service by that worker (quarantine).

Not the queue: nothing here changes a job. The supervisor writes, the API and monitoring read.
"""
from typing import Any

from sqlalchemy import insert, select, true, update
from sqlalchemy.engine import Engine

from trainyard.app.core.errors import Conflict, NotFound
from trainyard.app.core.states import WORKER_UNAVAILABLE
from trainyard.app.db import db_now, read, wakeup, workers, write
from trainyard.app.fleet import placement
from trainyard.app.records import Rank

LIVE = ("idle", "busy")
# Alive but unable to use its device (stats["unavailable"] says why): it claims nothing, and the jobs
# only it could take say why they wait.
UNAVAILABLE = WORKER_UNAVAILABLE


def register_worker(engine: Engine, worker_id: str, host: str, pid: int, device: str, stats: dict,
                    state: str = "idle") -> None:
    with write(engine) as conn:
        conn.execute(insert(workers).values(id=worker_id, host=host, pid=pid, device=device, state=state,
                                            stats=stats, started_at=db_now(), last_heartbeat=db_now()))


def worker_heartbeat(engine: Engine, worker_id: str, state: str, job_id: int | None,
                     stats: dict | None = None) -> str | None:
    """Record a worker's heartbeat. Returns why it is out of service when another worker took it out (quarantine)
    and it reports itself live: its row stays unavailable, saying why, and it is to claim nothing more."""
    values: dict[str, Any] = dict(state=state, job_id=job_id, last_heartbeat=db_now())
    if stats is not None:
        values["stats"] = stats
    held = None
    with write(engine) as conn:
        # Unavailable is for good: a live beat must not undo a quarantine it has not seen yet. The beat's own UPDATE
        # says so (no row changed), so the common beat stays one statement; only then is the reason read.
        live = workers.c.state != UNAVAILABLE if state in LIVE else true()
        if conn.execute(update(workers).where(workers.c.id == worker_id, live).values(**values)).rowcount == 0 \
                and state in LIVE:
            row = conn.execute(select(workers.c.stats).where(workers.c.id == worker_id, workers.c.state == UNAVAILABLE)
                               .with_for_update()).first()
            if row is not None:
                held = (row.stats or {}).get("unavailable") or "taken out of service"
                values.update(state=UNAVAILABLE, job_id=None, stats={**(stats or row.stats or {}), "unavailable": held})
                conn.execute(update(workers).where(workers.c.id == worker_id).values(**values))
    return held


def quarantine(engine: Engine, worker_id: str, reason: str) -> bool:
    """Take a live worker out of service from another worker (the device it lent a multi-device run failed
    under that run): unavailable, saying why, as its own mark_unavailable would. Only an idle or busy one (a
    worker stopping or stopped keeps its state); it learns at its next heartbeat. False: no such live worker."""
    with write(engine) as conn:
        row = conn.execute(select(workers.c.stats).where(workers.c.id == worker_id, workers.c.state.in_(LIVE))
                           .with_for_update()).first()
        if row is None:
            return False
        conn.execute(update(workers).where(workers.c.id == worker_id, workers.c.state.in_(LIVE)).values(
            state=UNAVAILABLE, job_id=None, stats={**(row.stats or {}), "unavailable": reason}))
    return True


def device_owner(ranks: list[Rank] | None, rank: Any) -> str | None:
    """The worker whose device rank `rank` of a multi-device run used (jobs.ranks, rank 0 first: the claimer's);
    None for a run on one device, or a rank the run does not have."""
    if not ranks or isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(ranks):
        return None
    return ranks[rank].get("worker")


def lent_to(engine: Engine, worker_id: str) -> int | None:
    """The multi-device job whose run this worker's device serves now, if any."""
    with read(engine) as conn:
        return conn.execute(select(workers.c.lent_to).where(workers.c.id == worker_id,
                                                            placement.lent(worker_id))).scalar()


def list_workers(engine: Engine, include_stopped: bool = False) -> tuple[list[dict], float]:
    """Workers and the database's current time (to judge heartbeat age)."""
    with read(engine) as conn:
        now = conn.execute(select(db_now())).scalar_one()
        q = select(workers).order_by(workers.c.started_at)
        if not include_stopped:
            q = q.where(workers.c.state != "stopped")
        rows = conn.execute(q).all()
    return [{str(k): v for k, v in r._mapping.items()} for r in rows], now


def still_placing(listed: list[dict], now: float, stale_after_s: float) -> list[dict]:
    """The workers a queued job may still get, as app/fleet/waiting.py weighs them: the live ones, and those alive
    but unable to use their device (their reason becomes the job's)."""
    return [w for w in listed if worker_state(w, now, stale_after_s) in (*LIVE, UNAVAILABLE)]


def worker_state(worker: dict, now: float, stale_after_s: float) -> str:
    """A worker's state as others should read it: 'lost' once it has missed a lease's worth of heartbeats."""
    if worker["state"] != "stopped" and now - worker["last_heartbeat"] > stale_after_s:
        return "lost"
    return worker["state"]


def set_draining(engine: Engine, worker_id: str, draining: bool) -> dict:
    """Drain a worker (it finishes its job and claims nothing more) or put it back. The claim reads the
    flag in the same statement that takes a job, so nothing is claimed once a drain has committed."""
    with write(engine) as conn:
        row = conn.execute(select(workers.c.state).where(workers.c.id == worker_id)).first()
        if row is None:
            raise NotFound(f"worker {worker_id} not found")
        if row.state == "stopped":
            raise Conflict(f"worker {worker_id} has stopped; a new worker process registers under a new id")
        conn.execute(update(workers).where(workers.c.id == worker_id).values(draining=draining))
        wakeup.notify(conn)
    found, _ = list_workers(engine)
    return next(w for w in found if w["id"] == worker_id)
