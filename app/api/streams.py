"""The event streams (Server-Sent Events) of one server process: the caps on how many are open, and the hub
that reads each watched sweep once per poll for all of its clients.

Each open stream holds a slot: at most `max_event_streams` in the process (job and sweep streams together),
and at most `max_event_streams_per_target` on one job or one sweep; past either, the request is answered
503 with Retry-After before any stream starts. A sweep's stream does not read the database itself: the hub
keeps one background task per watched sweep, which reads the sweep and its trials every poll, works out
what changed once, and hands the same encoded events to every subscriber. So N clients on a sweep cost one
read per poll, not N. A sweep's events are states, not deltas: a subscriber that is behind, or resumes after
a Last-Event-ID, is sent each trial and the sweep once, as they are now, if they changed after what it saw.
"""
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from typing import Any

import pydantic_core
from fastapi.concurrency import run_in_threadpool
from fastapi.sse import ServerSentEvent

from trainyard.app.errors import Invalid, Unavailable
from trainyard.app.states import JobState

log = logging.getLogger("trainyard.api")
# How long a watched sweep is still read after its last stream closed: a client that reconnects within it
# resumes after its Last-Event-ID; later, or on another server process, it is sent `reset` and the whole state.
RESUME_GRACE_S = 60.0


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


def _event(name: str, data: Any, event_id: str | None = None) -> ServerSentEvent:
    return ServerSentEvent(event=name, raw_data=pydantic_core.to_json(data).decode(), id=event_id)


def parse_sweep_event_id(text: str | None) -> tuple[int, int] | None:
    """A sweep stream's Last-Event-ID (`<watch>.<seq>`); None when absent; Invalid (422) when malformed."""
    if not text:
        return None
    watch, dot, seq = text.partition(".")
    if not (dot and watch.isdigit() and seq.isdigit() and len(watch) <= 18 and len(seq) <= 18):
        raise Invalid(f"Last-Event-ID: a sweep's event id is <watch>.<seq> as the stream sent it, not {text[:64]!r}")
    return int(watch), int(seq)


class _Watch:
    """One watched sweep: the latest event of each trial, of the sweep and the end, each with its sequence
    number (what a subscriber that is behind, new or resuming is sent: whatever changed after it), and its
    subscribers. Its events' ids are `<gen>.<seq>`: gen names this watch, and so which ids it can resume after."""

    def __init__(self, gen: int) -> None:
        self.gen, self.seq = gen, 0
        self.subscribers = 0
        self.idle_until = 0.0  # kept a while after its last subscriber leaves: a reconnect resumes
        self.trials: dict[int, tuple[int, ServerSentEvent]] = {}
        self.sweep: tuple[int, ServerSentEvent] | None = None
        self.end: tuple[int, ServerSentEvent] | None = None
        self.tick = asyncio.Event()  # set, and replaced, on every publish
        self.task: asyncio.Task | None = None

    def add(self, name: str, data: Any) -> tuple[int, ServerSentEvent]:
        self.seq += 1
        return self.seq, _event(name, data, f"{self.gen}.{self.seq}")

    def since(self, after: int) -> list[tuple[int, ServerSentEvent]]:
        """What changed after seq `after`, each trial and the sweep as they are now, in the order of their ids."""
        return sorted((e for e in (*self.trials.values(), self.sweep, self.end) if e is not None and e[0] > after),
                      key=lambda e: e[0])

    def publish(self) -> None:
        tick, self.tick = self.tick, asyncio.Event()
        tick.set()


class SweepHub:
    """read(sweep_id) -> the sweep without its spec, with its trials (sweep_fields' values), run in the thread pool."""

    def __init__(self, read: Callable[[int], dict], poll_s: float, resume_grace_s: float = RESUME_GRACE_S):
        self.read, self.poll_s, self.resume_grace_s = read, poll_s, resume_grace_s
        self.watched: dict[int, _Watch] = {}
        self.last_gen = 0

    async def events(self, sweep_id: int, last: tuple[int, int] | None = None) -> AsyncIterator[ServerSentEvent]:
        """`trial` for each trial whenever its state, epoch or metric changes, `sweep` whenever the sweep does,
        then `end` when the sweep has ended and none of its trials is queued or running. After `last` (an id
        this watch sent): what changed since; after an id it cannot resume from, `reset` and then everything."""
        watch = self.watched.get(sweep_id)
        if watch is None:
            # Ids of a later watch sort after an earlier one's: the watch's name is the time it started, in ms.
            self.last_gen = max(self.last_gen + 1, int(time.time() * 1000))
            watch = self.watched[sweep_id] = _Watch(self.last_gen)
            watch.task = asyncio.create_task(self._poll(sweep_id, watch), name=f"sweep-{sweep_id}-events")
        watch.subscribers += 1  # before any await: the poll task must see it
        after = 0
        try:
            if last is not None and last[0] == watch.gen and last[1] <= watch.seq:
                after = last[1]
            elif last is not None:
                yield _event("reset", {"id": sweep_id, "last_event_id": f"{last[0]}.{last[1]}"}, f"{watch.gen}.0")
            while True:
                tick = watch.tick
                for seq, event in watch.since(after):
                    yield event
                    after = seq
                if watch.end is not None and after >= watch.end[0]:
                    return
                await tick.wait()
        finally:
            watch.subscribers -= 1
            if not watch.subscribers:
                watch.idle_until = asyncio.get_running_loop().time() + self.resume_grace_s

    def _wanted(self, watch: _Watch) -> bool:
        return bool(watch.subscribers) or asyncio.get_running_loop().time() < watch.idle_until

    async def _poll(self, sweep_id: int, watch: _Watch) -> None:
        sent_sweep: dict[str, Any] | None = None
        sent_trials: dict[int, tuple] = {}
        try:
            while watch.end is None and (self._wanted(watch) or watch.sweep is None):
                try:
                    now = await run_in_threadpool(self.read, sweep_id)
                except Exception:  # the database away a moment: the streams wait, and the next poll tries again
                    log.exception("sweep %s events: read failed", sweep_id)
                    await asyncio.sleep(self.poll_s)
                    continue
                trials = now.pop("trials")
                now.pop("spec", None)  # not read for the stream: a client keeps the one GET /sweeps/{id} gave it
                changed = False
                for t in trials:
                    seen = (t["state"], t["failure"], t["epoch"], t["value"], t["best"])
                    if sent_trials.get(t["trial"]) != seen:
                        sent_trials[t["trial"]], changed = seen, True
                        watch.trials[t["trial"]] = watch.add("trial", t)
                if now != sent_sweep:
                    sent_sweep, changed = now, True
                    watch.sweep = watch.add("sweep", {**now, "trials": None})
                if now["state"] != "running" and not any(t["state"] in (JobState.QUEUED, JobState.RUNNING)
                                                         for t in trials):
                    watch.end = watch.add("end", {"id": now["id"], "state": now["state"]})
                if changed or watch.end is not None:
                    watch.publish()
                if watch.end is None:
                    await asyncio.sleep(self.poll_s)
            while self._wanted(watch):  # ended: what was sent stays for a reconnect a while
                await asyncio.sleep(self.poll_s)
        finally:
            if self.watched.get(sweep_id) is watch:
                del self.watched[sweep_id]
