"""The event streams (Server-Sent Events) of one server process: the caps on how many are open, and the hub
that reads each watched sweep once per poll for all of its clients.

Each open stream holds a slot: at most `max_event_streams` in the process (job and sweep streams together),
and at most `max_event_streams_per_target` on one job or one sweep; past either, the request is answered
503 with Retry-After before any stream starts. A sweep's stream does not read the database itself: the hub
keeps one background task per watched sweep, which reads the sweep and its trials every poll, works out
what changed once, and hands the same encoded events to every subscriber. So N clients on a sweep cost one
read per poll, not N.
"""
import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from typing import Any

import pydantic_core
from fastapi.concurrency import run_in_threadpool
from fastapi.sse import ServerSentEvent

from trainyard.app.errors import Unavailable
from trainyard.app.states import JobState

log = logging.getLogger("trainyard.api")
# Batches of events a subscriber may fall behind by before it is sent the whole current state instead.
BEHIND_BATCHES = 64


class StreamSlots:
    """Open event streams, counted per process and per job or sweep (asyncio: one thread, no lock)."""

    def __init__(self, total: int, per_target: int):
        self.total, self.per_target = total, per_target
        self.open: dict[str, int] = {}

    @contextmanager
    def hold(self, target: str):
        """A slot for one stream on target ("job 3", "sweep 2"); Unavailable (503, Retry-After) when full."""
        held = sum(self.open.values())
        if held >= self.total:
            raise Unavailable(f"this server process has {held} event streams open, its limit "
                              "(TRAINYARD_MAX_EVENT_STREAMS); retry shortly")
        if self.open.get(target, 0) >= self.per_target:
            raise Unavailable(f"{target} has {self.per_target} event streams open on this server process, its limit "
                              "(TRAINYARD_MAX_EVENT_STREAMS_PER_TARGET); retry shortly")
        self.open[target] = self.open.get(target, 0) + 1
        try:
            yield
        finally:
            self.open[target] -= 1
            if not self.open[target]:
                del self.open[target]


def _event(name: str, data: Any) -> ServerSentEvent:
    return ServerSentEvent(event=name, raw_data=pydantic_core.to_json(data).decode())


class _Watch:
    """One watched sweep: what was sent of it (so that a new subscriber starts from the same state) and its
    subscribers' queues."""

    def __init__(self) -> None:
        self.subscribers: set[asyncio.Queue] = set()
        self.trials: dict[int, ServerSentEvent] = {}
        self.sweep: ServerSentEvent | None = None
        self.end: ServerSentEvent | None = None
        self.task: asyncio.Task | None = None

    def replay(self) -> list[ServerSentEvent]:
        """The current state as events: every trial's latest, the sweep's, the end if it has come."""
        return [*(self.trials[k] for k in sorted(self.trials)), *filter(None, (self.sweep, self.end))]

    def publish(self, batch: list[ServerSentEvent]) -> None:
        for q in self.subscribers:
            try:
                q.put_nowait(batch)
            except asyncio.QueueFull:  # a slow client: drop what it has not read, send it the state instead
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(None)


class SweepHub:
    """read(sweep_id) -> the sweep without its spec, with its trials (sweep_fields' values), run in the thread pool."""

    def __init__(self, read: Callable[[int], dict], poll_s: float):
        self.read, self.poll_s = read, poll_s
        self.watched: dict[int, _Watch] = {}

    async def events(self, sweep_id: int) -> AsyncIterator[ServerSentEvent]:
        """`trial` for each trial whenever its state, epoch or metric changes, `sweep` whenever the sweep does,
        then `end` when the sweep has ended and none of its trials is queued or running."""
        watch = self.watched.get(sweep_id)
        if watch is None:
            watch = self.watched[sweep_id] = _Watch()
            watch.task = asyncio.create_task(self._poll(sweep_id, watch), name=f"sweep-{sweep_id}-events")
        q: asyncio.Queue = asyncio.Queue(maxsize=BEHIND_BATCHES)
        batch: list[ServerSentEvent] | None = watch.replay()
        watch.subscribers.add(q)
        try:
            while True:
                for event in batch if batch is not None else watch.replay():
                    yield event
                    if event is watch.end:
                        return
                batch = await q.get()
        finally:
            watch.subscribers.discard(q)

    async def _poll(self, sweep_id: int, watch: _Watch) -> None:
        sent_sweep: dict[str, Any] | None = None
        sent_trials: dict[int, tuple] = {}
        try:
            while watch.subscribers or watch.sweep is None:
                try:
                    now = await run_in_threadpool(self.read, sweep_id)
                except Exception:  # the database away a moment: the streams wait, and the next poll tries again
                    log.exception("sweep %s events: read failed", sweep_id)
                    await asyncio.sleep(self.poll_s)
                    continue
                trials = now.pop("trials")
                now.pop("spec", None)  # not read for the stream: a client keeps the one GET /sweeps/{id} gave it
                batch = []
                for t in trials:
                    seen = (t["state"], t["failure"], t["epoch"], t["value"], t["best"])
                    if sent_trials.get(t["trial"]) != seen:
                        sent_trials[t["trial"]] = seen
                        watch.trials[t["trial"]] = _event("trial", t)
                        batch.append(watch.trials[t["trial"]])
                if now != sent_sweep:
                    sent_sweep = now
                    watch.sweep = _event("sweep", {**now, "trials": None})
                    batch.append(watch.sweep)
                if now["state"] != "running" and not any(t["state"] in (JobState.QUEUED, JobState.RUNNING)
                                                         for t in trials):
                    watch.end = _event("end", {"id": now["id"], "state": now["state"]})
                    batch.append(watch.end)
                if batch:
                    watch.publish(batch)
                if watch.end is not None:
                    return
                await asyncio.sleep(self.poll_s)
        finally:
            if self.watched.get(sweep_id) is watch:
                del self.watched[sweep_id]
