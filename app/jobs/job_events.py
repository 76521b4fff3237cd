"""A job's event stream as a sequence (GET /jobs/{id}/events): the events its record holds now, in order,
each with its id, and where a Last-Event-ID resumes. The route (app/api/routes/events.py) polls this and sends.

An id is dotted whole numbers, compared part by part, and strictly increasing along the stream:

    <run>.<epoch>      an epoch's record: first those kept from earlier runs (up to the checkpoint the run
                       resumed from, K), then the run's own
    <run>.<K>.0        the run's opening state, between the two: queued in run 0 (never claimed), running in
                       run n (its n-th claim)
    <run>.<E>.<2k>     the state the run is in once it is no longer running, after its last epoch E: queued
                       again, or a terminal state; k grows with every such change within a run (see _key)
    <run>.<E>.<2k+1>   end, after a terminal state
    0                  reset: the Last-Event-ID was beyond this stream; the whole stream follows

Every id is derived from the stored job (its claim, state, errors and metrics), not from what one stream saw:
any server process resumes after any id the same way. The worker records a run's epochs before the state it
ends in (fenced writes, worker/supervisor/supervise.py), and the job is read before its metrics: so once a terminal
state
is read, every epoch of the run is read after it and goes out before it.
"""
from dataclasses import replace
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from trainyard.app.core.errors import Invalid
from trainyard.app.core.states import TERMINAL, JobState
from trainyard.app.db import metrics, read
from trainyard.app.records import Job, job_reads

EventId = tuple[int, ...]
RESET: EventId = (0,)
# An event: its name, its data (a Job for `state`, which the route makes JobPublic), its id.
Event = tuple[str, Any, EventId]


def parse(text: str | None) -> EventId | None:
    """A Last-Event-ID as an id; None when absent; Invalid (422) when it is not one this API's streams send."""
    if not text:
        return None
    parts = text.split(".")
    if not (all(p.isdigit() and len(p) <= 18 for p in parts) and (2 <= len(parts) <= 3 or text == "0")):
        raise Invalid("Last-Event-ID: an event id is dotted whole numbers (e.g. 1.12, as the stream sent it), "
                      f"not {text[:64]!r}")
    return tuple(int(p) for p in parts)


def show(event_id: EventId) -> str:
    return ".".join(map(str, event_id))


def _ended(job: Job) -> bool:
    """No longer in its opening state: its run ended (queued again, or terminal), or it was never run and ended."""
    return job.state != JobState.RUNNING and not (job.claim == 0 and job.state == JobState.QUEUED and not job.errors)


def _key(job: Job) -> int:
    """Grows with every change of state after a run (or, in run 0, after submission): a state that ends a run
    (terminal, or queued by a failure) adds an error to the job's history, and the only changes that add none
    come after it in the same run: succeeded or preempted (queued) after running, queued by a retry after
    failed or cancelled. So (errors, terminal before queued) orders them."""
    return 3 * len(job.errors or []) + (1 if job.state in TERMINAL else 2)


def last_epoch(engine: Engine, job_id: int) -> int:
    with read(engine) as conn:
        return conn.execute(select(func.max(metrics.c.epoch)).where(metrics.c.job_id == job_id)).scalar() or 0


def kept(engine: Engine, job: Job) -> int:
    """The last epoch the current run kept from earlier runs (the checkpoint it resumed from; 0 if none): its
    records are those older than the run's claim."""
    if not job.claim or job.started_at is None:
        return 0
    with read(engine) as conn:
        return conn.execute(select(func.max(metrics.c.epoch)).where(
            metrics.c.job_id == job.id, metrics.c.created_at < job.started_at)).scalar() or 0


def beyond(engine: Engine, job: Job, last: EventId) -> bool:
    """Whether `last` is past every event the job's stream holds now (a later run, an epoch not recorded,
    a state not reached): resuming after it would resume from somewhere else."""
    if last == RESET or last[0] < job.claim:
        return False
    if last[0] > job.claim:
        return True
    epoch = last_epoch(engine, job.id)
    if not _ended(job):
        return last > max((job.claim, epoch), (job.claim, kept(engine, job), 0))
    return last > (job.claim, epoch, 2 * _key(job) + (1 if job.state in TERMINAL else 0))


def _opened(job: Job, state: JobState, k: int) -> Job:
    """The job as its run opened, for the opening state: at the epoch it resumed from (k), no epoch of its own
    reported, not ended. A stream read after the run had gone on (or ended) would otherwise show its latest
    epoch, and then the run's epochs from the first (`submit --wait` printed epoch 20/20, then 1/20). Made of
    the job and k alone, the opening is the same event whichever event a read resumes after."""
    return replace(job, state=state, epoch=None if job.epoch is None else k, latest_metrics=None,
                   finished_at=None, result=None)


def following(engine: Engine, job_id: int, last: EventId | None, limit: int, max_bytes: int
              ) -> tuple[list[Event], str]:
    """The events after `last` (None or RESET: from the start), as far as one page of epochs; and what next:
    "more" (a page of epochs was full: ask again at once), "poll" (ask again after a while) or "over" (the job
    has ended and nothing of it is left to send). Read the job first: see the module."""
    job = job_reads.get_job(engine, job_id)
    run, ended, k = job.claim, _ended(job), kept(engine, job)
    if last is not None and last[0] == run and len(last) == 3 and last[2] == 0 and last[1] != k:
        # This run's opening moved: it could not read its checkpoint and started over (queue.start_over), so
        # the epochs the client has of earlier runs are no longer the job's.
        return [("reset", {"id": job.id, "last_event_id": show(last)}, RESET)], "more"
    if last is None or last == RESET or last[0] < run:
        # A client that saw an earlier run has its epochs up to the checkpoint this run resumed from.
        last = (run, 0 if last is None or last == RESET else min(last[1], k))
    opening = JobState.RUNNING if run else JobState.QUEUED
    open_now = (run, k, 0) > last and not (ended and job.state == opening)
    out: list[Event] = []
    records, more = job_reads.metrics_page(engine, job.id, last[1], limit, max_bytes)
    for m in records:
        if open_now and m["epoch"] > k:  # the run's own epochs come after its opening
            out.append(("state", _opened(job, opening, k), (run, k, 0)))
            open_now = False
        out.append(("epoch", m, (run, m["epoch"])))
    if more:
        return out, "more"
    if open_now:
        out.append(("state", _opened(job, opening, k), (run, k, 0)))
    if not ended:
        return out, "poll"
    epoch = records[-1]["epoch"] if records else last_epoch(engine, job.id)
    state_id: EventId = (run, epoch, 2 * _key(job))
    if state_id > last:
        out.append(("state", job, state_id))
    terminal = job.state in TERMINAL
    if terminal and state_id[:2] + (state_id[2] + 1,) > last:
        out.append(("end", {"id": job.id, "state": job.state}, state_id[:2] + (state_id[2] + 1,)))
    return out, "over" if terminal else "poll"
