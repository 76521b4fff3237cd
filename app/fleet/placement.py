"""Placement: which queued jobs a worker may take, and with which other devices.

A worker claims for a slot: its device (workers with one key share a GPU) and the memory that
device offers jobs that state theirs (`resources.gpu_memory_gb`). A job on several devices
(`devices: N`) is claimed by one idle worker that borrows N-1 other idle workers of its kind (`helpers`):
of its own host, or for a job spread over M hosts (`hosts: M`), N/M-1 of its own host and N/M on each of
M-1 others whose workers advertise an address (TRAINYARD_NODE_ADDR). Their devices become the job's other
ranks, and they claim nothing while that run lasts; on another host the first of them runs that host's
ranks (worker/supervisor/part.py). The queue's claim uses the SQL conditions here (`startable`); app/fleet/waiting.py
tells a
client, from the live workers, why a job has not started.

A job counts for more than it states on a GPU: its process's CUDA context (the driver's code, cuBLAS
and cuDNN workspaces: 0.5 to 1 GB) lies outside the allocator's cap that holds the job to its
statement, so jobs stated up to the card's total would still run it out. Each job on a GPU slot is
counted at its statement plus the slot's `headroom` (TRAINYARD_GPU_CONTEXT_HEADROOM_BYTES, 1 GiB by
default). And a job starts only within what NVML last saw free on the GPU (the slot's `free`, read by its
worker before each claim): a context still being freed, or another program's memory, holds it back.
"""
import functools
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Exists, ScalarSelect, and_, exists, false, func, or_, select, true
from sqlalchemy.engine import Connection, Engine

from trainyard.app.accounts import project_limits
from trainyard.app.core import device_names
from trainyard.app.core.settings import get_settings
from trainyard.app.core.states import WORKER_UNAVAILABLE as UNAVAILABLE
from trainyard.app.core.states import JobState
from trainyard.app.db import db_now, jobs, read, workers
from trainyard.app.db.tables import slurm_allocations
from trainyard.app.fleet import dependencies, fair_share
from trainyard.app.records import Rank

QUEUED, RUNNING = JobState.QUEUED.value, JobState.RUNNING.value


@dataclass(frozen=True)
class Slot:
    """The device a worker claims for. Workers with one key share that device (a GPU's UUID); `budget`
    is the memory it offers to jobs that state theirs (None: it takes no such job)."""
    key: str
    budget: int | None = None
    # Live, undrained workers of this kind on this host, this one included: the most devices a job here can span.
    gang: int = 1
    # Bytes each job stating its memory costs here beyond its statement (a GPU job's CUDA context); 0 on the CPU.
    headroom: int = 0
    # The address other hosts reach this host's ranks at (TRAINYARD_NODE_ADDR); None: no job across hosts here.
    addr: str | None = None
    # The bytes NVML said were free on this GPU when the worker last looked (before each claim; every process's
    # memory is not, a job's context still being freed and another program's included); None: not read.
    free: int | None = None
    # A worker an allocation started for one job (`trainyard worker --for-job`, app/clusters/): it takes that job
    # alone, and lends its device to that job's claim alone; None: a worker of the own fleet, which takes no job
    # that runs on Slurm.
    for_job: int | None = None
    # The Slurm job id of that worker's allocation: once the agent has seen it end, it takes nothing more.
    allocation: str | None = None


def eligible(device: str, plugins: dict[str, list[str]] | None, worker_id: str | None, slot: Slot | None,
             within_limits: ColumnElement[bool]) -> ColumnElement[bool]:
    """Queued jobs a worker could ever run: its device, its plugins (a job that needs a plugin waits for
    a worker that has it, rather than failing on one that does not), memory within its device's
    budget; every job it waits for (after, its model's job) succeeded; its project within its limits
    (`within_limits`: fair_share.limited's, read on the claim's connection). A draining worker can run none."""
    have = plugins or {}
    needs = [or_(column.is_(None), column.in_(have.get(kind, [])))
             for kind, column in (("models", jobs.c.need_model), ("datasets", jobs.c.need_dataset),
                                  ("entrypoints", jobs.c.need_entrypoint))]
    if worker_id is not None:
        needs.append(~exists().where(workers.c.id == worker_id, workers.c.draining.is_(True)))
        needs.append(~lent(worker_id))
        # Taken out of service by another worker (workers.quarantine): nothing more, even before it heartbeats.
        needs.append(~exists().where(workers.c.id == worker_id, workers.c.state == UNAVAILABLE))
    # The devices a job takes on each of its hosts (they divide evenly, app/spec) against this host's.
    needs.append(func.coalesce(jobs.c.devices, 1) / func.coalesce(jobs.c.hosts, 1) <= (slot.gang if slot else 1))
    if slot is None or slot.addr is None:
        needs.append(func.coalesce(jobs.c.hosts, 1) == 1)
    if slot is None or slot.budget is None:
        needs.append(jobs.c.need_gpu_memory.is_(None))
    else:
        needs.append(or_(jobs.c.need_gpu_memory.is_(None), jobs.c.need_gpu_memory + slot.headroom <= slot.budget))
    if slot is not None and slot.for_job is not None:
        needs.extend((jobs.c.id == slot.for_job, ~_ended(slot.allocation)))
    else:
        needs.append(jobs.c.runs_on.is_(None))
    needs.append(dependencies.ready())
    needs.append(within_limits)
    return and_(jobs.c.state == QUEUED, jobs.c.device_req.in_(device_names.accepted_by(device)), *needs)


# Built once: an alias's forty-odd column proxies, made again at each call, were a third of a claim's CPU.
_LENDER = jobs.alias("lender")


def lent(worker_id: str | ColumnElement[Any]) -> Exists:
    """The worker's device is a rank of a multi-device run that is still going (job and claim as lent)."""
    lender = _LENDER
    return exists().where(workers.c.id == worker_id, lender.c.id == workers.c.lent_to,
                          lender.c.claim == workers.c.lent_claim, lender.c.state == RUNNING)


def helpers(conn: Connection, worker_id: str, device: str, count: int, lease_s: float,
            lock: bool = False, hosts: int = 1, for_job: int | None = None) -> list[Rank] | None:
    """`count` idle workers to lend their devices to a job that worker_id claims on `count + 1` devices spread
    over `hosts` hosts: (count + 1) / hosts - 1 of its own host, the rest as many on each of hosts - 1 other
    hosts whose workers advertise an address (stats "addr"), the first hosts in name order that have them.
    Each is of the claimer's kind (every rank on a GPU, or every rank on the CPU), alive, not draining, not
    lent, running nothing, and (GPUs) on a distinct GPU nothing else runs on. Rank order: the claimer's host
    first, then host by host. None when there are not enough yet. lock: take their rows (PostgreSQL), as a
    claim does. for_job: a job that runs on Slurm, whose ranks are its allocation's workers alone (the others:
    no such worker)."""
    own = conn.execute(select(workers.c.host, workers.c.stats).where(workers.c.id == worker_id)).first()
    if own is None:
        return None
    per_host = (count + 1) // hosts
    kind = workers.c.device == "cpu" if device == "cpu" else workers.c.device.like("cuda%")
    busy = exists().where(jobs.c.worker_id == workers.c.id, jobs.c.state == RUNNING)
    q = (select(workers.c.id, workers.c.host, workers.c.device, workers.c.stats)
         .where(workers.c.id != worker_id, workers.c.state.in_(("idle", "busy")), kind,
                workers.c.last_heartbeat > db_now() - lease_s, ~workers.c.draining.is_(True),
                ~lent(workers.c.id), ~busy, true() if hosts > 1 else workers.c.host == own.host)
         .order_by(workers.c.host != own.host, workers.c.host, workers.c.device, workers.c.id))
    if lock:
        q = q.with_for_update(skip_locked=True, of=workers)
    taken = {k for (k,) in conn.execute(select(jobs.c.gpu_key).where(jobs.c.state == RUNNING,
                                                                    jobs.c.gpu_key.is_not(None)))}
    taken.add(((own.stats or {}).get("slot") or {}).get("key"))
    groups: dict[str, list[Rank]] = {}
    for w in conn.execute(q):
        stats = w.stats or {}
        key = (stats.get("slot") or {}).get("key", w.id)
        if device != "cpu" and key in taken:  # two ranks on one GPU would only contend for it
            continue
        if w.host != own.host and not stats.get("addr"):  # its ranks could not be reached
            continue
        if (stats.get("slot") or {}).get("for_job") != for_job:  # an allocation's worker serves its job alone
            continue
        group = groups.setdefault(w.host, [])
        if len(group) < per_host - (w.host == own.host):
            taken.add(key)
            rank: Rank = {"worker": w.id, "device": w.device, "key": key, "host": w.host}
            if hosts > 1:
                rank["addr"] = stats["addr"]
            group.append(rank)
    chosen = groups.get(own.host, [])
    if len(chosen) < per_host - 1:
        return None
    others = [g for h, g in groups.items() if h != own.host and len(g) == per_host][:hosts - 1]
    if len(others) < hosts - 1:
        return None
    return [*chosen, *(w for g in others for w in g)]


def first_rank(conn: Connection, worker_id: str, device: str, slot: Slot | None, port: int,
               others: list[Rank]) -> Rank:
    """Rank 0's entry in a claimed job's ranks: the claimer; across hosts also where the ranks meet, its
    host's address and a port free there (`port`)."""
    host = conn.execute(select(workers.c.host).where(workers.c.id == worker_id)).scalar()
    rank: Rank = {"worker": worker_id, "device": device, "key": slot.key if slot else worker_id, "host": host or ""}
    if "addr" in others[0] and slot is not None and slot.addr:
        rank["addr"], rank["port"] = slot.addr, str(port)
    return rank


def ended(engine: Engine, job_id: int, allocation: str | None) -> bool:
    """Whether an allocation's worker, bound to job_id, is done: the job is over (or deleted), or the agent saw its
    allocation end (its nodes are no longer the job's). A run of the job lost meanwhile (requeued) is claimed
    again by the same workers, within the allocation."""
    with read(engine) as conn:
        state = conn.execute(select(jobs.c.state).where(jobs.c.id == job_id)).scalar()
        gone = conn.execute(select(_ended(allocation))).scalar()
    return state not in (QUEUED, RUNNING) or bool(gone)


def _ended(allocation: str | None) -> Exists:
    # "" for none (a worker started by hand with --for-job): no allocation has it, where None would read IS NULL.
    return exists().where(slurm_allocations.c.slurm_id == (allocation or ""), slurm_allocations.c.ended_at.is_not(None))


def lent_gpus(conn: Connection) -> set[str]:
    """The GPUs (slot keys) that running multi-device jobs borrowed: no other job may start on them, even
    through another worker that shares one of them."""
    rows = conn.execute(select(jobs.c.ranks).where(jobs.c.state == RUNNING))
    return {r.get("key") for (ranks,) in rows if ranks for r in ranks[1:] if r["device"] != "cpu"}


def fits_now(slot: Slot | None) -> ColumnElement[bool]:
    """The job fits beside what runs on the slot's device now: a job that stated its memory, within the
    budget left and beside no whole-device job, and (its statement and context) within what NVML last saw
    free there; one that did not, on an otherwise idle device."""
    if slot is None:
        return true()
    other = jobs.alias("other")
    on_device = and_(other.c.state == RUNNING, other.c.gpu_key == slot.key)
    stated = other.c.need_gpu_memory + slot.headroom  # each running job's statement and its context
    used = select(func.coalesce(func.sum(stated), 0)).where(on_device).scalar_subquery()
    whole = exists().where(on_device, other.c.need_gpu_memory.is_(None))
    # What the running jobs stated counts against the budget (a job claimed a moment ago has allocated
    # nothing yet); what NVML sees in use, against the card: a context still being freed, a job past its
    # statement, another program's memory. One bound each (no GREATEST, which SQLite lacks).
    seen = [jobs.c.need_gpu_memory + slot.headroom <= slot.free] if slot.free is not None else []
    shares = and_(jobs.c.need_gpu_memory.is_not(None), ~whole,
                  jobs.c.need_gpu_memory + slot.headroom + used <= slot.budget, *seen) \
        if slot.budget is not None else false()
    return or_(and_(jobs.c.need_gpu_memory.is_(None), ~exists().where(on_device)), shares)


def head(device: str, plugins: dict[str, list[str]] | None, worker_id: str | None, slot: Slot | None,
         fair: ColumnElement[Any] | None, within_limits: ColumnElement[bool]) -> ScalarSelect[Any]:
    """The job at the head of this worker's line: the project furthest under its fair share first (`fair`:
    app/fleet/fair_share.py's Ranking.term; None when fewer than two projects compete), then priority, then age. Jobs
    are
    placed in that order without backfill: a head that does not fit yet is waited for (devices free up), so a
    large job behind a stream of small ones waits at most for the jobs running when it reached the head. It
    takes no row lock: claims take turns (queue.claim), and a lock with SKIP LOCKED would let a claim look past
    a head that an idle worker's has_work read was holding at that moment, and start a later job before it."""
    frozen = tuple(sorted((kind, tuple(names)) for kind, names in (plugins or {}).items()))
    return (select(jobs.c.id).where(_eligible(device, frozen, worker_id, slot), within_limits)
            .order_by(*([fair] if fair is not None else []), jobs.c.priority.desc(), jobs.c.id)
            .limit(1).scalar_subquery())


# A worker's conditions are the same at every look and claim while its slot is: built once each (building them
# was most of a claim's CPU: the jobs aliases' column proxies, the plugins' IN lists), not per call.
@functools.lru_cache(maxsize=64)
def _eligible(device: str, plugins: tuple[tuple[str, tuple[str, ...]], ...], worker_id: str | None,
              slot: Slot | None) -> ColumnElement[bool]:
    return eligible(device, {kind: list(names) for kind, names in plugins}, worker_id, slot, true())


_fits_now = functools.lru_cache(maxsize=64)(fits_now)


def startable(conn: Connection, device: str, plugins: dict[str, list[str]] | None, worker_id: str | None,
              slot: Slot | None, lease_s: float, lock: bool,
              memo: fair_share.Memo | None = None) -> tuple[int, list[Rank]] | None:
    """The job at the head of this worker's line, if it can start now, and the other ranks it would
    borrow (none for a one-device job). A head that cannot start holds the worker back (no backfill).
    memo: a claim cycle's (app/fleet/idle_look.py): fair share's reading made by its look is used again by its claim
    when the same projects (or fewer) compete, and is left there for it."""
    competing = fair_share.competing(conn, device)
    if not competing:
        return None  # nothing queued for this device: no other read
    held = project_limits.read(conn)  # once, for both terms
    ranking = memo.ranking if memo is not None else None
    if ranking is None or not ranking.covers(competing):
        ranking = fair_share.ranking(conn, get_settings().fair_share_half_life_s, held, competing)
        if memo is not None:
            memo.ranking = ranking
    within_limits = fair_share.limited(conn, device, held)
    first = conn.execute(select(jobs.c.id, jobs.c.devices, jobs.c.hosts, jobs.c.runs_on).where(
        jobs.c.id == head(device, plugins, worker_id, slot, ranking.term(), within_limits), _fits_now(slot))).first()
    if first is None:
        return None
    if slot is not None and device != "cpu" and slot.key in lent_gpus(conn):
        return None  # this worker's GPU is a rank of another worker's multi-device job
    if (first.devices or 1) == 1:
        return first.id, []
    if worker_id is None:
        return None
    others = helpers(conn, worker_id, device, first.devices - 1, lease_s, lock=lock, hosts=first.hosts or 1,
                     for_job=first.id if first.runs_on else None)
    return None if others is None else (first.id, others)
