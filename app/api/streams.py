"""The event streams (Server-Sent Events) of one server process: the caps on how many are open, and the hub
that reads each watched sweep once per poll for all of its clients.

Each open stream holds a slot: at most `max_event_streams` in the process (job and sweep streams together),
at most `max_event_streams_per_target` on one job or one sweep, and a member's at most their project's part of the
first (`Settings.per_project`); past any, the request is answered 503 with Retry-After before any stream starts.
A sweep's stream does not read the database itself: the hub keeps one background task per watched sweep, which
reads the sweep and its trials every poll, works out what changed once, and hands the same encoded events to every
subscriber. So N clients on a sweep cost one read per poll, not N. A sweep's events are states, not deltas: a
subscriber that is behind, or resumes after a Last-Event-ID, is sent each trial and the sweep once, as they are
now, if they changed after what it saw.

An open stream goes on serving only whom it was opened for: every RECHECK_S it asks again whether the caller's
token still holds (Recheck), and when it does not (revoked, its user taken out of its project or deleted) the
stream sends `end` naming why and closes. The check is one indexed read per stream each RECHECK_S, made only
when the interval has passed, never per poll or per event; the admin's TRAINYARD_API_TOKEN and the open
loopback admin are not users' tokens and are not re-read.
"""
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pydantic_core
from fastapi.concurrency import run_in_threadpool
from fastapi.sse import ServerSentEvent

from trainyard.app.accounts import Principal
from trainyard.app.core.errors import Invalid, Unavailable
from trainyard.app.core.states import JobState

log = logging.getLogger("trainyard.api")
# How long a watched sweep is still read after its last stream closed: a client that reconnects within it
# resumes after its Last-Event-ID; later, or on another server process, it is sent `reset` and the whole state.
RESUME_GRACE_S = 60.0
# How often an open stream re-checks its caller's token: how long a revoked token may go on reading at most.
RECHECK_S = 2.0
# The data of the `end` a stream sends when its caller's token no longer holds (after it: 401 on reconnecting).
TOKEN_GONE = "token no longer valid"


class StreamSlots:
    """Open event streams, counted per process, per job or sweep, and per project of a member's (asyncio: one
    thread, no lock). A member's stream meets their project's part of the process's cap first (per_project,
    TRAINYARD_MAX_EVENT_STREAMS_PER_PROJECT), so that one project's streams leave room for the others'; admins'
    and streams in no project meet the cap itself. A refusal counts the caller's own project's streams only."""

    def __init__(self, total: int, per_target: int, per_project: int | None = None):
        self.total, self.per_target = total, per_target
        self.per_project = per_project if per_project is not None else max(1, total // 2)
        self.open: dict[str, int] = {}
        self.projects: dict[int, int] = {}

    @contextlib.contextmanager
    def hold(self, target: str, who: Principal | None = None):
        """A slot for one stream on target ("job 3", "sweep 2") opened by who; Unavailable (503, Retry-After) when
        full."""
        project = who.project_id if who is not None and not who.admin else None
        if project is not None and self.projects.get(project, 0) >= self.per_project:
            raise Unavailable(f"project {who.project if who else ''} has {self.projects[project]} event streams open "
                              "on this server process, its part of the server's "
                              f"({self.per_project}, TRAINYARD_MAX_EVENT_STREAMS_PER_PROJECT); close some, or retry "
                              "shortly")
        if sum(self.open.values()) >= self.total:  # said without the count: other projects' streams are theirs
            raise Unavailable("this server process has as many event streams open as it allows "
                              "(TRAINYARD_MAX_EVENT_STREAMS); retry shortly")
        if self.open.get(target, 0) >= self.per_target:
            raise Unavailable(f"{target} has {self.per_target} event streams open on this server process, its limit "
                              "(TRAINYARD_MAX_EVENT_STREAMS_PER_TARGET); retry shortly")
        self.open[target] = self.open.get(target, 0) + 1
        if project is not None:
            self.projects[project] = self.projects.get(project, 0) + 1
        try:
            yield
        finally:
            self.open[target] -= 1
            if not self.open[target]:
                del self.open[target]
            if project is not None:
                self.projects[project] -= 1
                if not self.projects[project]:
                    del self.projects[project]


def _event(name: str, data: Any, event_id: str | None = None) -> ServerSentEvent:
    return ServerSentEvent(event=name, raw_data=pydantic_core.to_json(data).decode(), id=event_id)


class Recheck:
    """Whether an open stream's caller still holds its right: still_holds() (an awaitable read) asked at most
    once every `every_s`; None for a caller with nothing to re-read (the admin's TRAINYARD_API_TOKEN)."""

    def __init__(self, still_holds: Callable[[], Awaitable[bool]] | None, every_s: float = RECHECK_S):
        self.still_holds, self.every_s = still_holds, every_s
        self.due = asyncio.get_running_loop().time() + every_s  # the request was authenticated just now

    def due_in(self) -> float | None:
        """Seconds until the next check (how long a stream may wait for news); None: never."""
        if self.still_holds is None:
            return None
        return max(0.0, self.due - asyncio.get_running_loop().time())

    async def holds(self) -> bool:
        """False once the caller's token no longer holds. A read only when the interval has passed."""
        if self.still_holds is None:
            return True
        now = asyncio.get_running_loop().time()
        if now < self.due:
            return True
        self.due = now + self.every_s
        return await self.still_holds()

    def gone(self, target_id: int) -> ServerSentEvent:
        """The `end` that closes the stream of a caller whose token no longer holds: no id (nothing to resume)."""
        return _event("end", {"id": target_id, "reason": TOKEN_GONE})


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

    async def events(self, sweep_id: int, last: tuple[int, int] | None = None, caller: Recheck | None = None
                     ) -> AsyncIterator[ServerSentEvent]:
        """`trial` for each trial whenever its state, epoch or metric changes, `sweep` whenever the sweep does,
        then `end` when the sweep has ended and none of its trials is queued or running. After `last` (an id
        this watch sent): what changed since; after an id it cannot resume from, `reset` and then everything.
        With `caller`: `end` naming why as soon as the caller's token no longer holds (checked every RECHECK_S)."""
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
                if caller is not None and not await caller.holds():
                    yield caller.gone(sweep_id)
                    return
                tick = watch.tick
                for seq, event in watch.since(after):
                    yield event
                    after = seq
                if watch.end is not None and after >= watch.end[0]:
                    return
                # Woken by news, or when the caller's token is due its check (a quiet sweep sends nothing).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(caller.due_in() if caller is not None else None):
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
