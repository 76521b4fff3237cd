"""Fair share between projects, and their limits on devices and GPU memory: which project's queued job a free
device goes to.

The next claim goes to the project with the least recent device time for its share, as Slurm's fair-share does:
each project's device-seconds (a run's length times its devices), each weighed down by half every
TRAINYARD_FAIR_SHARE_HALF_LIFE_S since the run ended (a running job's count in full), divided by the project's
share (projects.share, 1 by default). Then priority, then age, within it (app/fleet/placement.py's head of the line).
A project alone on the fleet uses all of it; two projects with queued jobs each get devices in proportion to
their shares over time. Jobs of no project (the admin token's, or made before projects) are one more project,
of share 1.

The device time is read from the jobs' rows, and only when it can change the order: when queued jobs of two or more
projects compete for the claiming worker's device (`competing`); with one project or none, fair share orders
nothing, and the claim orders by priority and age alone. Then it reads, for the competing projects only, every
job that runs or ended within eight half-lives (their weight past it is under 1/256; the index on (project_id,
finished_at) holds the read to that window, whatever retention keeps). A worker's look at the queue and the claim
that follows it share one reading (`Ranking`, held by app/fleet/idle_look.py's Look for a claim cycle). A job's earlier
runs (before a retry or a requeue) are not in its row and are not counted: a preempted job's project is
under-counted by its lost run.

A project's limits (projects.limits) on what its running jobs hold at once are kept here, at the claim: its
queued jobs are not eligible past them (`limited`), and wait saying which (`at_limit`); none fails for them.
  - `devices`: the devices its running jobs hold, this one's included, at most the limit;
  - `gpu_memory_gb`: the GPU memory its running jobs stated (resources.gpu_memory_gb, without the headroom a
    slot adds for a CUDA context), this one's included, at most the limit times 1e9 bytes. A job of such a
    project that may run on a GPU (device other than cpu) and states no memory waits too: it could take a whole
    GPU. So does a multi-device one (it takes whole GPUs and may state none): such a project runs those on the
    CPU. Running jobs that stated nothing (from before the limit) count as nothing.
The limits checked at submit (queued jobs, running sweeps, stored bytes) are app/accounts/quotas.py's. Shares and
limits are
read through app/accounts/project_limits.py, held to the bounds there: the SQL here holds them as literals, never
casts a
stored value, so no row can make a claim or a housekeeping pass fail.
"""
import functools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Integer, and_, case, func, literal, or_, select, true, union_all
from sqlalchemy.engine import Connection
from sqlalchemy.sql import Select
from sqlalchemy.sql.elements import ColumnElement

from trainyard.app.accounts import project_limits
from trainyard.app.core import device_names
from trainyard.app.core.states import JobState
from trainyard.app.db import db_now, jobs
from trainyard.app.records import Job

# Every project's bounded share and limits (project_limits.read): a caller that needs several of the terms below
# reads them once and passes them to each.
Held = dict[int, project_limits.ProjectLimits]

RUNNING, QUEUED = JobState.RUNNING.value, JobState.QUEUED.value
WINDOW = 8  # half-lives


def usage(conn: Connection, half_life_s: float,
          projects: Collection[int | None] | None = None) -> tuple[dict[int | None, float], float]:
    """Each project's decayed device-seconds (None: jobs of no project), and the database's now. projects: only
    these (None among them: jobs of no project); None: every project."""
    now = conn.execute(select(db_now())).scalar_one()
    cols = (jobs.c.project_id, jobs.c.devices, jobs.c.started_at, jobs.c.finished_at, jobs.c.state)
    # Two arms, each on an index: the running jobs (state), the window's ended ones ((project_id, finished_at)).
    # A running job's finished_at is NULL (the claim clears it), so no job is read by both.
    running = select(*cols).where(jobs.c.state == RUNNING, jobs.c.started_at.is_not(None))
    ended = select(*cols).where(jobs.c.finished_at > now - WINDOW * half_life_s, jobs.c.started_at.is_not(None),
                                jobs.c.state != RUNNING)
    if projects is not None:
        ids = [p for p in projects if p is not None]
        mine = or_(jobs.c.project_id.in_(ids), *([jobs.c.project_id.is_(None)] if None in projects else []))
        running, ended = running.where(mine), ended.where(mine)
    used: dict[int | None, float] = {}
    for project_id, devices, started_at, finished_at, state in conn.execute(union_all(running, ended)):
        end = now if state == RUNNING or finished_at is None else finished_at
        seconds = max(0.0, end - started_at) * (devices or 1)
        used[project_id] = used.get(project_id, 0.0) + seconds * 0.5 ** (max(0.0, now - end) / half_life_s)
    return used, now


def competing(conn: Connection, device: str | None = None) -> set[int | None]:
    """The projects (None: jobs of no project) with queued jobs that a worker of `device` may take (None: any
    worker): those whose order fair share decides. One read of the queued jobs (ix_jobs_queued_device)."""
    return {p for (p,) in conn.execute(_competing(device))}


@functools.lru_cache(maxsize=16)
def _competing(device: str | None) -> Select:
    q = select(jobs.c.project_id).where(jobs.c.state == QUEUED).distinct()
    return q if device is None else q.where(jobs.c.device_req.in_(device_names.accepted_by(device)))


@dataclass(frozen=True)
class Ranking:
    """Fair share's reading for some competing projects: each one's decayed device time over its share."""
    projects: frozenset[int | None]
    ranks: dict[int | None, float]

    def term(self) -> ColumnElement[Any] | None:
        """The ORDER BY term for queued jobs, lowest first; None when it is constant (fewer than two projects
        compete, or none has run): the order is priority, then age."""
        if len(self.projects) < 2 or not any(self.ranks.values()):
            return None
        named = {p: r for p, r in self.ranks.items() if p is not None}
        alone = case((jobs.c.project_id.is_(None), self.ranks.get(None, 0.0)), else_=0.0)
        return case(named, value=jobs.c.project_id, else_=alone) if named else alone

    def covers(self, projects: Collection[int | None]) -> bool:
        return set(projects) <= self.projects


@dataclass
class Memo:
    """One claim cycle's reading: a worker's look at the queue makes it, the claim that follows uses it again."""
    ranking: Ranking | None = None


def ranking(conn: Connection, half_life_s: float, held: Held | None = None,
            projects: Collection[int | None] | None = None, used: dict[int | None, float] | None = None) -> Ranking:
    """Fair share's reading for `projects` (competing's; None: those with any queued job), from `used` when given
    (usage's, for these projects at least). With fewer than two, no read at all: fair share cannot change their
    order."""
    projects = frozenset(competing(conn) if projects is None else projects)
    if len(projects) < 2:
        return Ranking(projects, {})
    used = usage(conn, half_life_s, projects)[0] if used is None else used
    shares = shares_of(conn, held)
    return Ranking(projects, {p: used.get(p, 0.0) / (shares.get(p, 1.0) if p is not None else 1.0)
                              for p in projects})


def shares_of(conn: Connection, held: Held | None = None) -> dict[int, float]:
    """Each project's share (finite, > 0), by id."""
    return {p: h.share for p, h in (project_limits.read(conn) if held is None else held).items()}


def limited(conn: Connection, device: str | None = None, held: Held | None = None) -> ColumnElement[bool]:
    """The job's project may start it now: within its `devices` and `gpu_memory_gb` limits (those it has), with
    its running jobs. device: the claiming worker's ("cpu": a job that states no memory runs on the CPU there, so
    the memory limit does not hold it back; None: any worker, so it does)."""
    held = project_limits.read(conn) if held is None else held
    devices = {p: h.limits["devices"] for p, h in held.items() if "devices" in h.limits}
    memory = {p: round(h.limits["gpu_memory_gb"] * 1e9) for p, h in held.items() if "gpu_memory_gb" in h.limits}
    terms = [*([_within_devices(devices)] if devices else []), *([_within_memory(memory, device)] if memory else [])]
    return or_(jobs.c.project_id.is_(None), and_(*terms)) if terms else true()


def _cap(caps: dict[int, int], kind: Any) -> Any:
    """The job's project's limit of caps (NULL: none), as a literal of each project's bounded value."""
    return case({p: literal(v, kind) for p, v in caps.items()}, value=jobs.c.project_id)


# Built once (an alias's column proxies cost more than the rest of the term).
_RUNNING_OF = {column: jobs.alias(f"project_running_{column}") for column in ("devices", "need_gpu_memory")}


def _held(column: str, default: int) -> Any:
    """The sum of a column over the job's project's running jobs."""
    other = _RUNNING_OF[column]
    return select(func.coalesce(func.sum(func.coalesce(other.c[column], default)), 0)).where(
        other.c.state == RUNNING, other.c.project_id == jobs.c.project_id).scalar_subquery()


def _within_devices(caps: dict[int, int]) -> ColumnElement[bool]:
    cap = _cap(caps, Integer)
    return or_(cap.is_(None), _held("devices", 1) + func.coalesce(jobs.c.devices, 1) <= cap)


def _within_memory(caps: dict[int, int], device: str | None) -> ColumnElement[bool]:
    cap = _cap(caps, BigInteger)  # bytes
    unstated = jobs.c.device_req == "cpu" if device != "cpu" else true()
    stated = and_(jobs.c.need_gpu_memory.is_not(None),
                  _held("need_gpu_memory", 0) + jobs.c.need_gpu_memory <= cap)
    return or_(cap.is_(None), and_(jobs.c.need_gpu_memory.is_(None), unstated), stated)


def at_limit(conn: Connection, queued: list[Job]) -> dict[int, str]:
    """Why each of these queued jobs waits for its project's `devices` or `gpu_memory_gb` limit (only those that
    do). A job that states no GPU memory is said to wait for it whenever it may run on a GPU: this reading does not
    know which worker would take it."""
    wanted = {j.project_id for j in queued if j.project_id is not None}
    if not wanted:
        return {}
    limits = {p: (h.name, h.limits) for p, h in project_limits.read(conn, wanted).items()}
    held = {r.project_id: (int(r.devices or 0), int(r.memory or 0)) for r in conn.execute(
        select(jobs.c.project_id, func.sum(func.coalesce(jobs.c.devices, 1)).label("devices"),
               func.sum(func.coalesce(jobs.c.need_gpu_memory, 0)).label("memory")).where(
            and_(jobs.c.state == RUNNING, jobs.c.project_id.in_(wanted))).group_by(jobs.c.project_id))}
    out = {}
    for j in queued:
        if j.project_id is None or j.project_id not in limits:
            continue
        name, lim = limits[j.project_id]
        why = _over(j, name, lim, *held.get(j.project_id, (0, 0)))
        if why:
            out[j.id] = why
    return out


def _over(j: Job, name: str, lim: dict[str, Any], devices: int, memory: int) -> str | None:
    cap, gb = lim.get("devices"), lim.get("gpu_memory_gb")
    if cap is not None and devices + (j.devices or 1) > cap:
        return (f"project {name} is at its limit of {cap} device{'s' if cap != 1 else ''} in use at once "
                f"({devices} held by its running jobs)")
    if gb is None:
        return None
    if j.need_gpu_memory is None and j.device_req != "cpu":
        if (j.devices or 1) > 1:
            return (f"project {name} limits its GPU memory to {gb:g} GB (gpu_memory_gb): a job on several GPUs "
                    "takes them whole and may not run there; ask for device cpu, or ask an admin")
        return (f"project {name} limits its GPU memory to {gb:g} GB (gpu_memory_gb): a job that may run on a GPU "
                "must state resources.gpu_memory_gb (or ask for device cpu)")
    if j.need_gpu_memory is not None and memory + j.need_gpu_memory > gb * 1e9:
        return (f"project {name} is at its limit of {gb:g} GB of GPU memory in use at once (gpu_memory_gb): its "
                f"running jobs stated {memory / 1e9:.1f} GB, this one {j.need_gpu_memory / 1e9:.1f} GB")
    return None


def standing(used: dict[int | None, float], shares: dict[int, float],
             active: set[int | None]) -> dict[int | None, float]:
    """Each active project's part of the active projects' decayed device time (`used`: usage's) over its part of
    their shares (`shares`: by project id; jobs of no project weigh 1): under 1.0 it is under its fair share, over
    1.0 over it. Before anything has run, every project stands at 1.0 (app/fleet/preemption.py)."""
    share = {p: max(shares.get(p, 1.0) if p is not None else 1.0, 1e-9) for p in active}
    total_used, total_share = sum(used.get(p, 0.0) for p in active), sum(share.values())
    if total_used <= 0:
        return {p: 1.0 for p in active}
    return {p: (used.get(p, 0.0) / total_used) / (share[p] / total_share) for p in active}
