"""Routes for the event streams (Server-Sent Events): a job's (GET /jobs/{id}/events, its sequence and ids in
app/jobs/job_events.py) and a sweep's (GET /sweeps/{id}/events, served by the hub in app/api/streams.py). What they
promise a client (order, ids, resuming, an id beyond the stream, the end) is docs/api.md's "Event streams". A
stream of another project's job or sweep is 404 before it starts, as a missing one's is. An open stream re-checks
its caller's token every few seconds and ends (`end` naming why) once it no longer holds (app/api/streams.py)."""
import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.sse import EventSourceResponse, ServerSentEvent

from trainyard.app.api.deps import COOKIE, EngineDep, WhoDep, bearer, require_token
from trainyard.app.api.routes.jobs import MAX_METRICS_PAGE, JobId
from trainyard.app.api.routes.sweeps import NOT_FOUND as SWEEP_NOT_FOUND
from trainyard.app.api.routes.sweeps import SweepId
from trainyard.app.api.schemas import NOT_FOUND as JOB_NOT_FOUND
from trainyard.app.api.schemas import JobPublic
from trainyard.app.api.streams import Recheck, parse_sweep_event_id
from trainyard.app.jobs import job_events as sequence
from trainyard.app.records import Job, sweep_reads, visibility

router = APIRouter()
EVENTS_POLL_S = 0.25
LastEventId = Annotated[str | None, Header(max_length=64, description=(
    "the id of the last event a client had: the stream resumes after it (docs/api.md, Event streams)"))]
STREAM: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events"},
    422: {"description": "a Last-Event-ID that is not an event id"}}


async def existing_job(job_id: JobId, engine: EngineDep, who: WhoDep) -> Job:
    """The job, or 404 before a stream starts (another project's too)."""
    return await run_in_threadpool(visibility.job_for, engine, who, job_id)


def job_resume(last_event_id: LastEventId = None) -> sequence.EventId | None:
    """The Last-Event-ID, parsed before the stream starts: 422 naming it when it is not an event id."""
    return sequence.parse(last_event_id)


def sweep_resume(last_event_id: LastEventId = None) -> tuple[int, int] | None:
    return parse_sweep_event_id(last_event_id)


async def caller_recheck(request: Request, who: WhoDep) -> Recheck:
    """The stream's check that its caller is still whom the stream was opened for: the request authenticated
    again, as require_token does it (a token revoked, expired, its user taken out of the project, deleted or no
    longer an admin; a dashboard session signed out: no longer). TRAINYARD_API_TOKEN and the open admin at the
    machine are no user's token or session: nothing to re-read."""
    credentials = await bearer(request)
    if who.token_id is None and (credentials is not None or COOKIE not in request.cookies):
        return Recheck(None)

    async def still_holds() -> bool:
        try:
            return await require_token(request, credentials) == who
        except HTTPException:
            return False
    return Recheck(still_holds)


CallerDep = Annotated[Recheck, Depends(caller_recheck)]


async def job_stream_slot(job_id: JobId, request: Request, who: WhoDep) -> AsyncIterator[None]:
    """A slot for the job's event stream: 503 past the caps on open streams (app/api/streams.py)."""
    with request.app.state.streams.hold(f"job {job_id}", who):
        yield


@router.get("/jobs/{job_id}/events", tags=["jobs"], operation_id="job_events", response_class=EventSourceResponse,
            dependencies=[Depends(job_stream_slot)],
            responses={**STREAM, **JOB_NOT_FOUND, 503: {"description": "too many event streams open (on this job, "
                                                                        "or on this server process)"}})
async def job_events(job: Annotated[Job, Depends(existing_job)], engine: EngineDep, request: Request,
                     last: Annotated[sequence.EventId | None, Depends(job_resume)], caller: CallerDep,
                     ) -> AsyncIterator[ServerSentEvent]:
    """Server-Sent Events: `state` when the job is queued, when each run starts and when it stops running,
    `epoch` for each epoch's metrics, then `end` once it has ended: every epoch of a run before the state it
    ends in, the terminal state before `end`, `end` last. Each event has its own id, increasing along the stream;
    with `Last-Event-ID` the stream resumes after that event; an id beyond the stream gets `reset` and then the
    whole stream. A stream whose token no longer holds (revoked, its user out of the project) ends with `end`
    naming why (`{"id": job, "reason": "token no longer valid"}`) within a few seconds."""
    if last is not None and await run_in_threadpool(sequence.beyond, engine, job, last):
        yield ServerSentEvent(event="reset", data={"id": job.id, "last_event_id": sequence.show(last)},
                              id=sequence.show(sequence.RESET))
        last = sequence.RESET
    max_bytes = request.app.state.settings.max_list_bytes
    while not await request.is_disconnected():
        if not await caller.holds():  # a read only every RECHECK_S, not per poll
            yield caller.gone(job.id)
            return
        # A page of epochs at a time: a job that reported megabytes an epoch is never read whole.
        events, then = await run_in_threadpool(sequence.following, engine, job.id, last, MAX_METRICS_PAGE, max_bytes)
        for name, data, event_id in events:
            yield ServerSentEvent(event=name, data=JobPublic.from_job(data) if name == "state" else data,
                                  id=sequence.show(event_id))
            last = event_id
        if then == "over":
            return
        if then == "poll":
            await asyncio.sleep(EVENTS_POLL_S)


async def sweep_stream_slot(sweep_id: SweepId, engine: EngineDep, who: WhoDep, request: Request
                            ) -> AsyncIterator[None]:
    """The sweep (404 before a stream starts, another project's too) and a slot for its stream (503 when the caps
    are reached)."""
    await run_in_threadpool(sweep_reads.get_summary, engine, sweep_id, who)
    with request.app.state.streams.hold(f"sweep {sweep_id}", who):
        yield


@router.get("/sweeps/{sweep_id}/events", tags=["sweeps"], operation_id="sweep_events",
            response_class=EventSourceResponse, dependencies=[Depends(sweep_stream_slot)],
            responses={**STREAM, **SWEEP_NOT_FOUND,
                       503: {"description": "too many event streams open (on this sweep, or on this server process)"}})
async def sweep_events(sweep_id: SweepId, request: Request,
                       last: Annotated[tuple[int, int] | None, Depends(sweep_resume)], caller: CallerDep,
                       ) -> AsyncIterator[ServerSentEvent]:
    """Server-Sent Events: `trial` (a trial as it is now) whenever a trial's state, epoch or metric changes,
    `sweep` (the sweep without its spec and trials) whenever it changes, then `end` when the sweep has ended,
    last. The stream starts with every trial as it stands. Each event has its own id, increasing along the
    stream; with `Last-Event-ID` it resumes after that event with what changed since, or, where this server
    process cannot, sends `reset` and then the whole state. One read of the sweep per poll serves all of its
    streams (app/api/streams.py). A stream whose token no longer holds ends with `end` naming why within a few
    seconds, as a job's does."""
    async for event in request.app.state.sweep_hub.events(sweep_id, last, caller):
        yield event
