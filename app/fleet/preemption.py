"""Priority preemption: which running job gives its device to a queued one that no free device can take,
asking for it (jobs.preempt_requested_at), and the supervisor's look at its job's fence and that request.

A pass (the server's housekeeper runs one a second: app/duties/loops.py) looks at the head of each device
class's line (the job the claim would take next: fair share, then priority, then age). When no live, undrained,
idle worker serves that class, it may take the device of a running job that has run at least
TRAINYARD_PREEMPT_MIN_RUN_S since it was claimed, on a device that serves the class, when the victim is of lower
priority, or of a project over its fair share while the queued job's is under its own; and only when the queued
job would be claimed before the victim once the victim is back in the queue, so the device it frees goes to it
(no ping-pong). Of those, the lowest priority, then the youngest run. One victim per device class at a time:
while a requested preemption is under way, nothing more is asked of that class.

The victim's worker sees the request at its next fence check and stops the job as a SIGTERM would: it
checkpoints and is requeued by queue.requeue_preempted, using no attempt. A request belongs to the run it was
made for: one made before the job's last claim (a run lost in between) is no longer in force. Torch-free.
"""
import logging
from dataclasses import dataclass
from enum import StrEnum

from sqlalchemy import ColumnElement, and_, exists, func, or_, select, update
from sqlalchemy.engine import Engine, Row

from trainyard.app import accounts
from trainyard.app.accounts import audit, project_limits
from trainyard.app.core import device_names
from trainyard.app.core.settings import Settings
from trainyard.app.core.states import JobState
from trainyard.app.db import db_now, jobs, read, workers, write
from trainyard.app.fleet import dependencies, fair_share

log = logging.getLogger("trainyard.preemption")
QUEUED, RUNNING = JobState.QUEUED.value, JobState.RUNNING.value


def _in_force() -> ColumnElement[bool]:
    """A preemption requested of the job's current run (made since its claim)."""
    return and_(jobs.c.preempt_requested_at.is_not(None), jobs.c.preempt_requested_at >= jobs.c.started_at)


class Fence(StrEnum):
    """What the supervisor's look at its job's row (fence) found."""
    OURS = "ours"
    PREEMPT = "preempt"  # asked to give its device up
    LOST = "lost"        # the job is no longer ours: cancelled, pruned, ended or taken over


def fence(engine: Engine, job_id: int, claim_no: int) -> Fence:
    """The supervisor's check, one read."""
    with read(engine) as conn:
        row = conn.execute(select(_in_force().label("asked")).where(
            jobs.c.id == job_id, jobs.c.claim == claim_no, jobs.c.state == RUNNING)).first()
    return Fence.LOST if row is None else Fence.PREEMPT if row.asked else Fence.OURS


@dataclass(frozen=True)
class _Run:
    id: int
    claim: int
    priority: int
    project_id: int | None
    device: str
    started_at: float
    seconds: float  # device-seconds of this run so far


def choose(engine: Engine, settings: Settings) -> list[tuple[int, int, int]]:
    """(victim id, victim claim, for job id) for each device class whose head should preempt now."""
    with read(engine) as conn:
        now = conn.execute(select(db_now())).scalar_one()
        idle = [d for (d,) in conn.execute(select(workers.c.device).where(
            workers.c.state == "idle", workers.c.last_heartbeat > now - settings.lease_s,
            ~workers.c.draining.is_(True)))]
        served_idle = {req for d in idle for req in device_names.accepted_by(d)}
        rows = conn.execute(select(jobs.c.id, jobs.c.claim, jobs.c.priority, jobs.c.project_id, jobs.c.device,
                                   jobs.c.started_at, jobs.c.devices, _in_force().label("asked"))
                            .where(jobs.c.state == RUNNING, jobs.c.device.is_not(None),
                                   jobs.c.runs_on.is_(None))).all()  # Slurm preempts its own (app/clusters/)
        queued = fair_share.competing(conn)
        if not rows or not queued:
            return []  # nothing runs to preempt, or nothing waits: no other read
        held = project_limits.read(conn)  # once, for the limits, the rank and the shares below
        # Fair share's reading, for the projects whose jobs wait or run only (those standing and _served_first
        # weigh): the rank term orders the queued ones, the usage weighs them against the running ones.
        used, _ = fair_share.usage(conn, settings.fair_share_half_life_s, queued | {r.project_id for r in rows})
        fair = fair_share.ranking(conn, settings.fair_share_half_life_s, held, queued, used).term()
        heads = conn.execute(select(jobs.c.id, jobs.c.device_req, jobs.c.priority, jobs.c.project_id).where(
            jobs.c.state == QUEUED, func.coalesce(jobs.c.devices, 1) == 1, dependencies.ready(),
            jobs.c.runs_on.is_(None), fair_share.limited(conn, held=held)).order_by(
                *([fair] if fair is not None else []), jobs.c.priority.desc(), jobs.c.id)).all()
        shares = fair_share.shares_of(conn, held)
    runs = [_Run(r.id, r.claim, r.priority, r.project_id, r.device, r.started_at,
                 max(0.0, now - r.started_at) * (r.devices or 1)) for r in rows if not r.asked]
    pending = {req for r in rows if r.asked for req in device_names.accepted_by(r.device)}
    active = {h.project_id for h in heads} | {r.project_id for r in rows}  # of those read above
    standing = fair_share.standing(used, shares, active)
    chosen: list[tuple[int, int, int]] = []
    seen: set[str] = set()
    for head in heads:
        if head.device_req in seen:
            continue
        seen.add(head.device_req)  # only a class's head may preempt: the claim takes it first
        if head.device_req in served_idle or head.device_req in pending:
            continue
        taken = {v for v, _, _ in chosen}
        victims = [r for r in runs if r.id not in taken and head.device_req in device_names.accepted_by(r.device)
                   and now - r.started_at >= settings.preempt_min_run_s and _may_preempt(head, r, standing)
                   and _served_first(head, r, used, shares)]
        if victims:
            victim = min(victims, key=lambda r: (r.priority, -r.started_at))
            chosen.append((victim.id, victim.claim, head.id))
    return chosen


def _may_preempt(head: Row, victim: _Run, standing: dict[int | None, float]) -> bool:
    """The issue's rule: the victim is of lower priority, or the queued job's project is under its share and
    the victim's over its own (so never a job of the same priority and project)."""
    return victim.priority < head.priority or (
        standing.get(head.project_id, 0.0) < 1.0 < standing.get(victim.project_id, 0.0))


def _served_first(head: Row, victim: _Run, used: dict[int | None, float], shares: dict[int, float]) -> bool:
    """The claim would take `head` before the victim once the victim is requeued (its run then no longer
    counts in its project's device time): the device it frees goes to the job it was freed for."""
    def rank(project_id: int | None) -> float:
        seconds = used.get(project_id, 0.0) - (victim.seconds if project_id == victim.project_id else 0.0)
        return seconds / max(shares.get(project_id, 1.0) if project_id is not None else 1.0, 1e-9)
    return (rank(head.project_id), -head.priority, head.id) < (rank(victim.project_id), -victim.priority, victim.id)


def request(engine: Engine, victim_id: int, claim_no: int, for_job_id: int) -> bool:
    """Ask the victim's run to give its device up: one guarded UPDATE (still that run, nothing asked of it yet, the
    job it is for still queued), audited as the scheduler's (the admin's) "preempt". False when either changed."""
    waiting = jobs.alias("waiting")
    with write(engine) as conn:
        res = conn.execute(update(jobs).where(
            jobs.c.id == victim_id, jobs.c.claim == claim_no, jobs.c.state == RUNNING,
            or_(jobs.c.preempt_requested_at.is_(None), jobs.c.preempt_requested_at < jobs.c.started_at),
            exists().where(waiting.c.id == for_job_id, waiting.c.state == QUEUED))
            .values(preempt_requested_at=db_now()))
    if res.rowcount != 1:
        return False
    audit.record(engine, accounts.ADMIN, "preempt", f"job {victim_id}", None, {"for": for_job_id})
    log.info("job %s preempted for job %s", victim_id, for_job_id)
    return True


def run_pass(engine: Engine, settings: Settings) -> list[tuple[int, int]]:
    """One pass: choose, then request each; (victim, for job) of the requests made."""
    return [(victim, for_job) for victim, claim_no, for_job in choose(engine, settings)
            if request(engine, victim, claim_no, for_job)]
