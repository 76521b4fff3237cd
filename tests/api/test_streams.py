"""The event streams as a third-party client meets them (docs/api.md, Event streams): the real server and a CPU
worker, read with httpx-sse and sseclient-py, and trainyard.Client. Every epoch of a run comes before the state
it ends in, `end` last; every event has its own id, increasing; a reconnect with Last-Event-ID resumes right
after that event; an id beyond the stream gets `reset` and then the whole stream."""
import json
import os
import signal

import pytest
import sseclient
from httpx_sse import connect_sse

from tests.helpers.backends import BACKENDS
from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.service import live_service
from trainyard import Client

pytestmark = pytest.mark.slow  # starts the real server and a worker

WAITING = {**tiny_job(), "device": "cuda"}  # no worker serves CUDA here: it stays queued until cancelled
GRID = {"job": tiny_job(epochs=3), "method": "grid", "max_concurrent": 1,
        "parameters": {"train.lr": {"type": "choice", "values": [0.01, 0.05, 0.1]}}}


# A server and a CPU worker, on SQLite and on PostgreSQL (whose transactions interleave differently).
live = live_service(backends=BACKENDS)


def key(event_id: str | None) -> tuple[int, ...]:
    assert event_id, "an event without an id"
    return tuple(int(p) for p in event_id.split("."))


def follow(svc, path: str, last_event_id: str | None = None, stop=None) -> list[tuple[str, str | None, dict]]:
    """(event, id, data) of the stream at path, read with httpx-sse, until it closes or stop(event) is true."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    out: list[tuple[str, str | None, dict]] = []
    with svc.client(timeout=120) as c, connect_sse(c, "GET", path, headers=headers) as source:
        assert source.response.status_code == 200
        for sse in source.iter_sse():
            out.append((sse.event, sse.id, sse.json()))
            if stop is not None and stop(out[-1]):
                break
    return out


def read_all(svc, path: str, last_event_id: str | None = None) -> list[tuple[str, str | None, dict]]:
    """The same, read with sseclient-py over httpx's byte chunks (a client of another make)."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    with svc.client(timeout=120) as c, c.stream("GET", path, headers=headers) as r:
        assert r.status_code == 200
        return [(e.event, e.id, json.loads(e.data)) for e in sseclient.SSEClient(r.iter_bytes()).events()]


def assert_ordered(events, epochs: int, final: str) -> None:
    """Ids strictly increasing; every epoch once, in order, all before the terminal state; `end` after it, last."""
    names = [e[0] for e in events]
    assert [e[2]["epoch"] for e in events if e[0] == "epoch"] == list(range(1, epochs + 1))
    assert names[-2:] == ["state", "end"] and events[-2][2]["state"] == final and events[-1][2]["state"] == final
    assert [e[2]["state"] for e in events if e[0] == "state"].count(final) == 1
    assert all(e[1] for e in events) and [key(e[1]) for e in events] == sorted({key(e[1]) for e in events})


def test_a_job_stream_ends_with_every_epoch_then_its_terminal_state_then_end(live):
    # Fast jobs end between two polls of their stream, right after their last epochs: the race that sent the
    # terminal state before them. Followed from submission, each stream must hold all of it in order.
    ids = [live.submit(tiny_job(epochs=12))["id"] for _ in range(4)]
    for job_id in ids:
        events = follow(live, f"/jobs/{job_id}/events")
        assert_ordered(events, 12, "succeeded")
        assert events[-1][2] == {"id": job_id, "state": "succeeded"}
        assert_ordered(read_all(live, f"/jobs/{job_id}/events"), 12, "succeeded")  # opened once it has ended
    # A job that fails, and one cancelled before it ran: each still ends with its terminal state, then end.
    bad = live.submit({**tiny_job(), "model": {"arch": "cifar_net"}})["id"]  # iris rows are not images
    assert_ordered(read_all(live, f"/jobs/{bad}/events"), 0, "failed")
    waiting = live.submit(WAITING)["id"]
    with live.client() as c:
        assert c.post(f"/jobs/{waiting}/cancel").status_code == 200
    events = read_all(live, f"/jobs/{waiting}/events")
    assert [(e[0], e[1], e[2].get("state")) for e in events] == [
        ("state", "0.0.0", "queued"), ("state", "0.0.8", "cancelled"), ("end", "0.0.9", "cancelled")]
    assert_ordered(events, 0, "cancelled")


def test_a_third_party_client_follows_and_resumes_a_job(live):
    job_id = live.submit(tiny_job(epochs=6))["id"]
    # Follow it live and drop the connection after its second epoch; resume with the last id it had.
    first = follow(live, f"/jobs/{job_id}/events", stop=lambda e: e[0] == "epoch" and e[2]["epoch"] == 2)
    rest = follow(live, f"/jobs/{job_id}/events", last_event_id=first[-1][1])
    assert rest[0][0] != "reset" and key(rest[0][1]) > key(first[-1][1])
    assert_ordered(first + rest, 6, "succeeded")
    # After the end: resuming after any event gives exactly what came after it in the whole stream.
    whole = read_all(live, f"/jobs/{job_id}/events")
    assert_ordered(whole, 6, "succeeded")
    for i, (_, event_id, _) in enumerate(whole):
        assert read_all(live, f"/jobs/{job_id}/events", last_event_id=event_id) == whole[i + 1:], event_id
    assert [e[1] for e in whole[-2:]] == [e[1] for e in rest[-2:]]  # the same ids, whoever asked


def test_a_resumed_job_streams_its_kept_epochs_then_its_new_run_and_resumes_across_runs(service):
    a = service.start_worker("cpu")
    job_id = service.submit(slow_job(epochs=30))["id"]
    path = f"/jobs/{job_id}/events"
    seen = follow(service, path, stop=lambda e: e[0] == "epoch" and e[2]["epoch"] >= 2)
    service.wait_until(lambda: (service.job(job_id)["checkpoint_epoch"] or 0) >= 2, 120, "a checkpoint")
    os.kill(a.pid, signal.SIGTERM)  # a graceful stop: the job is queued again, to resume from its checkpoint
    assert a.wait(timeout=30) == 0
    # The rest of run 1's epochs, then the state it ended in (queued again), after them.
    pre = follow(service, path, last_event_id=seen[-1][1], stop=lambda e: e[0] == "state")
    assert pre[-1][2]["state"] == "queued" and all(e[0] == "epoch" for e in pre[:-1])
    assert key(pre[-1][1])[:2] == (1, (pre[-2] if len(pre) > 1 else seen[-1])[2]["epoch"])
    service.start_worker("cpu")
    done = service.wait_state(job_id, timeout=240)
    kept = done["result"]["resumed_from_epoch"]
    assert done["state"] == "succeeded" and done["runs"] == 2 and kept >= 2
    # A stream opened now: the epochs kept from run 1, run 2's opening, its own epochs, its end.
    whole = read_all(service, path)
    assert_ordered(whole, 30, "succeeded")
    assert [e[0] for e in whole[:kept + 1]] == ["epoch"] * kept + ["state"]
    assert whole[kept][1:] == (f"2.{kept}.0", {**whole[kept][2], "state": "running"})
    assert read_all(service, path, last_event_id=f"2.{kept}.0") == whole[kept + 1:]  # none of the kept again
    # The client that saw run 1 up to its epoch e has its epochs up to min(e, kept): the rest, under run 2's ids.
    had = min(seen[-1][2]["epoch"], kept)
    assert read_all(service, path, last_event_id=seen[-1][1]) == [e for e in whole if key(e[1]) > (2, had)]


def test_an_id_beyond_the_stream_gets_reset_then_the_whole_stream(live):
    job_id = live.submit(tiny_job(epochs=3))["id"]
    live.wait_state(job_id)
    whole = read_all(live, f"/jobs/{job_id}/events")
    for beyond in ("99.99", "1.50", "1.3.99"):
        events = read_all(live, f"/jobs/{job_id}/events", last_event_id=beyond)
        assert events[0] == ("reset", "0", {"id": job_id, "last_event_id": beyond}) and events[1:] == whole
    # The reset's own id resumes from the start, as the stream after it did.
    assert read_all(live, f"/jobs/{job_id}/events", last_event_id="0") == whole
    with live.client() as c:
        r = c.get(f"/jobs/{job_id}/events", headers={"Last-Event-ID": "latest"})
        assert r.status_code == 422 and "Last-Event-ID" in r.text
        r = c.get("/sweeps/1/events", headers={"Last-Event-ID": "1.2.3"})
        assert r.status_code in (404, 422)


def test_a_third_party_client_follows_and_resumes_a_sweep(live):
    with live.client() as c:
        made = c.post("/sweeps", json=GRID).json()
    path = f"/sweeps/{made['id']}/events"
    # Follow it until a trial has run an epoch, drop the connection, resume with the last id it had.
    first = follow(live, path, stop=lambda e: e[0] == "trial" and (e[2]["epoch"] or 0) >= 1)
    rest = follow(live, path, last_event_id=first[-1][1])
    seen = first + rest
    assert rest[0][0] != "reset" and all(e[1] for e in seen)
    assert [key(e[1]) for e in seen] == sorted({key(e[1]) for e in seen})  # no id twice, none going back
    assert seen[-1][0] == "end" and seen[-1][2]["state"] == "succeeded"
    # Nothing lost: the last event of each trial is the trial as the sweep holds it now.
    with live.client() as c:
        trials = {t["trial"]: t for t in c.get(f"/sweeps/{made['id']}").json()["trials"]}
    latest = {e[2]["trial"]: e[2] for e in seen if e[0] == "trial"}
    assert latest.keys() == trials.keys()
    assert all(latest[n][k] == trials[n][k] for n in trials for k in ("state", "epoch", "value", "best", "job_id"))
    # Resuming after the end: nothing more, and the stream closes. An id of no stream of this server: reset.
    assert read_all(live, path, last_event_id=seen[-1][1]) == []
    events = read_all(live, path, last_event_id="7.99")
    assert events[0][0] == "reset" and events[-1][0] == "end" and len({e[2]["trial"] for e in events
                                                                       if e[0] == "trial"}) == 3
    with live.client() as c:
        r = c.get(path, headers={"Last-Event-ID": "1.x"})
        assert r.status_code == 422 and "Last-Event-ID" in r.text


def test_the_client_follows_and_resumes_jobs_and_sweeps(live):
    with Client(live.url) as client:
        job = client.jobs.submit(tiny_job(epochs=3))
        with pytest.warns(DeprecationWarning):  # the old spelling still works
            whole = list(client.events(job.id))
        assert [e["event"] for e in whole][-2:] == ["state", "end"]
        later = list(client.jobs.events(job.id, last_event_id=whole[1]["id"]))
        assert later == whole[2:]
        sweep = client.sweeps.submit({**GRID, "parameters": {"train.lr": {"type": "choice", "values": [0.02]}}})
        assert list(client.sweeps.events(sweep.id))[-1]["event"] == "end"
        # Read again once it has ended: each trial and the sweep as they are now, then end (states, not changes).
        events = list(client.sweeps.events(sweep.id))
        assert [e["event"] for e in events] == ["trial", "sweep", "end"] and all(e["id"] for e in events)
        with pytest.warns(DeprecationWarning):
            assert list(client.sweep_events(sweep.id, last_event_id=events[0]["id"])) == events[1:]
        assert list(client.sweeps.events(sweep.id, last_event_id=events[-1]["id"])) == []
