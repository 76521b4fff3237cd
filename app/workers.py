"""The worker registry: workers register, heartbeat with their state and device stats, and are judged lost.

Not the queue: nothing here changes a job. The supervisor writes, the API and monitoring read.
"""
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Engine

from trainyard.app import placement, wakeup
from trainyard.app.db import db_now, read, workers, write
from trainyard.app.errors import Conflict, NotFound
from trainyard.app.states import WORKER_UNAVAILABLE

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
                     stats: dict | None = None) -> None:
    values: dict[str, Any] = dict(state=state, job_id=job_id, last_heartbeat=db_now())
    if stats is not None:
        values["stats"] = stats
    with write(engine) as conn:
        conn.execute(update(workers).where(workers.c.id == worker_id).values(**values))


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
    """The workers a queued job may still get, as placement.waiting weighs them: the live ones, and those alive
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
