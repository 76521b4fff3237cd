"""What reading sweeps costs the server, whatever the sweeps hold: the list of sweeps with large specs, the
curves of a sweep with half a million points, hundreds of event streams on one sweep, and a cancel that races
a job's ending. A real server on a real database; memory and CPU from /proc, bytes and time from the wire.
(Big sweeps and points are written straight into the server's database: submitting them would only be slow.)"""
import asyncio
import os
import threading
import time

import httpx
import psycopg
import pytest
from sqlalchemy import insert, text, update

from tests.helpers.jobs import tiny_job
from tests.helpers.processes import rss
from tests.helpers.service import Service
from trainyard.app.db import jobs, make_engine, metrics, sweeps, write
from trainyard.app.jobs import submit
from trainyard.app.launcher import postgres_schema
from trainyard.app.spec import SweepSpec, TrainJob

pytestmark = pytest.mark.slow
MiB = 1 << 20
STREAMS = 300  # TRAINYARD_MAX_EVENT_STREAMS_PER_TARGET's default
TOTAL = STREAMS + 10  # the process's cap in these tests: ten more, for job streams


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    svc = Service(tmp_path_factory.mktemp("sweep-reads") / "data", env={"TRAINYARD_MAX_EVENT_STREAMS": str(TOTAL)})
    svc.start_server()
    svc.engine = make_engine(f"sqlite:///{svc.env['TRAINYARD_DATA_DIR']}/trainyard.db")
    yield svc
    svc.engine.dispose()
    svc.stop()


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def big_sweep(values: int, method: str = "random") -> dict:
    """A stored sweep spec of about 0.8 MiB, nearly all of it one parameter's choices (as a release before
    the bound of 1,000 choice values could store it)."""
    spec = SweepSpec.model_validate({
        "job": tiny_job(), "method": method, "max_trials": None if method == "grid" else 30,
        "parameters": {"model.hidden": {"type": "choice", "values": [[1]]}}}).model_dump(mode="json")
    spec["parameters"]["model.hidden"]["values"] = [[i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6]
                                                    for i in range(10, 10 + values)]
    return spec


def stored_sweep(svc, spec: dict, state: str = "cancelled") -> int:
    with write(svc.engine) as conn:
        return conn.execute(insert(sweeps).values(name="big", state=state, spec=spec, created_at=time.time(),
                                                  trial_count=0).returning(sweeps.c.id)).scalar_one()


def trial_jobs(svc, sweep_id: int, n: int, state: str = "succeeded") -> list[int]:
    spec = TrainJob.model_validate(tiny_job())
    with write(svc.engine) as conn:
        made = [submit.insert_job(conn, spec, sweep={"id": sweep_id, "trial": t, "params": {"train.lr": 0.01}}).id
                for t in range(n)]
        conn.execute(update(jobs).where(jobs.c.id.in_(made)).values(state=state))
    return made


def test_the_sweeps_list_leaves_specs_out_and_costs_little_whatever_they_hold(live):
    ids = [stored_sweep(live, big_sweep(10_000)) for _ in range(11)]
    grid = stored_sweep(live, big_sweep(500, method="grid"))  # max_trials: the grid's size, from its parameters
    before = rss(live.server.pid)
    with live.client(timeout=60) as c:
        t0 = time.monotonic()
        r = c.get("/sweeps", params={"limit": 100})
        took = time.monotonic() - t0
        one = c.get(f"/sweeps/{ids[0]}").json()
    assert r.status_code == 200
    page = r.json()
    print(f"GET /sweeps?limit=100 of 12 sweeps of 0.8 MiB specs: {len(r.content):,} bytes in {took:.2f} s, "
          f"server RSS +{(rss(live.server.pid) - before) / MiB:.0f} MiB")
    assert {s["id"] for s in page["data"]} >= {*ids, grid}
    assert all(s["spec"] is None for s in page["data"])
    by_id = {s["id"]: s for s in page["data"]}
    assert by_id[grid]["max_trials"] == 500 and by_id[grid]["method"] == "grid"
    assert by_id[ids[0]]["max_trials"] == 30 and by_id[ids[0]]["direction"] == "minimize"
    assert len(r.content) < 64 * 1024 and took < 1.0
    # GET /sweeps/{id} keeps the spec.
    assert len(one["spec"]["parameters"]["model.hidden"]["values"]) == 10_000 and one["max_trials"] == 30
    assert rss(live.server.pid) - before < 200 * MiB


def test_curves_come_in_pages_bounded_in_bytes_and_time_and_the_cursor_brings_only_new_points(live):
    sweep_id = stored_sweep(live, big_sweep(10))
    trials = trial_jobs(live, sweep_id, 1000)
    with write(live.engine) as conn:
        conn.execute(insert(metrics), [dict(job_id=j, epoch=e, attempt=1, created_at=0.0,
                                            data={"val_loss": 1.0 / e, "train_loss": 2.0})
                                       for j in trials for e in range(1, 501)])
    got, pages, since, slowest, largest = 0, 0, 0, 0.0, 0
    before = rss(live.server.pid)
    with live.client(timeout=60) as c:
        while True:
            t0 = time.monotonic()
            r = c.get(f"/sweeps/{sweep_id}/curves", params={"since": since})
            slowest, largest = max(slowest, time.monotonic() - t0), max(largest, len(r.content))
            page = r.json()
            assert len(page["trials"]) == 1000 and page["metric"] == "val_loss"
            got += sum(len(t["points"]) for t in page["trials"])
            pages += 1
            since = page["next"]
            if not page["more"]:
                break
        print(f"curves of 500,000 points: {pages} pages, the largest {largest:,} bytes, the slowest {slowest:.2f} s, "
              f"server RSS +{(rss(live.server.pid) - before) / MiB:.0f} MiB")
        assert got == 500_000 and pages == 50
        assert largest < MiB and slowest < 2.0
        # Nothing new: an empty page. Then one trial's new epoch, and an epoch recorded again, come alone.
        assert sum(len(t["points"]) for t in c.get(f"/sweeps/{sweep_id}/curves", params={"since": since})
                   .json()["trials"]) == 0
        with write(live.engine) as conn:
            conn.execute(insert(metrics).values(job_id=trials[7], epoch=501, attempt=1, created_at=0.0,
                                                data={"val_loss": 0.5}))
        page = c.get(f"/sweeps/{sweep_id}/curves", params={"since": since, "limit": 5}).json()
        assert [(t["trial"], t["points"]) for t in page["trials"] if t["points"]] == [(7, [[501, 0.5]])]
        assert page["more"] is False and page["next"] > since
        assert c.get(f"/sweeps/{sweep_id}/curves", params={"limit": 0}).status_code == 422
        assert c.get(f"/sweeps/{sweep_id}/curves", params={"limit": 10_001}).status_code == 422


async def _open_streams(url: str, path: str, n: int, opened: list, stop: asyncio.Event):
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=n + 10)) as c:
        async def one():
            async with c.stream("GET", path) as r:
                opened.append(r.status_code)
                if r.status_code != 200:
                    return
                it = r.aiter_text()
                await it.__anext__()  # the first events
                await stop.wait()
                await it.aclose()
        await asyncio.gather(*(one() for _ in range(n)))


def test_hundreds_of_streams_on_one_sweep_share_one_poll_and_the_caps_hold(live):
    with live.client() as c:
        job = c.post("/jobs", json=tiny_job()).json()  # no worker: it stays queued, and so do the trials
        made = c.post("/sweeps", json={"job": tiny_job(), "method": "random", "max_trials": 8,
                                       "parameters": {"train.lr": {"type": "float", "low": 1e-3, "high": 0.1}}}).json()
    opened: list[int] = []
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    streams = threading.Thread(target=loop.run_until_complete,
                               args=(_open_streams(live.url, f"/sweeps/{made['id']}/events", STREAMS, opened, stop),))
    streams.start()
    try:
        live.wait_until(lambda: len(opened) == STREAMS, 60, "the streams to open")
        assert opened == [200] * STREAMS
        time.sleep(1)
        pid = live.server.pid
        latencies: list[float] = []
        with live.client() as c:
            # The connection is made before the clock starts: a first SYN the kernel drops is resent only
            # after 1 s (the initial RTO), which timed the handshake and not the server (one read of 1,000.4 ms
            # in a CI run whose median was 10 ms). What is timed is reads on one kept-alive connection.
            assert c.get("/healthz").status_code == 200
            cpu0, t0 = cpu_s(pid), time.monotonic()
            while time.monotonic() - t0 < 5:
                s = time.monotonic()
                assert c.get(f"/jobs/{job['id']}").status_code == 200
                latencies.append(time.monotonic() - s)
                time.sleep(0.05)
            cpu = (cpu_s(pid) - cpu0) / (time.monotonic() - t0)
            slowest = max(range(len(latencies)), key=latencies.__getitem__)
            latencies.sort()
            p90 = latencies[len(latencies) * 9 // 10]
            print(f"{STREAMS} streams on one sweep: server CPU {cpu:.0%}, GET /jobs/{{id}} median "
                  f"{latencies[len(latencies) // 2] * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms, "
                  f"max {latencies[-1] * 1000:.1f} ms (read {slowest} of {len(latencies)})")
            # p90, not max: on two cores beside another xdist process one read in ~80 can wait 300 ms for the
            # scheduler; 300 streams polling on their own would slow most reads, not one
            assert cpu < 0.5 and p90 < 0.25 and latencies[-1] < 1.0
            # One more on the sweep: 503 with Retry-After, naming the limit.
            r = c.get(f"/sweeps/{made['id']}/events")
            assert r.status_code == 503 and r.headers["Retry-After"] and "TRAINYARD_MAX_EVENT_STREAMS_PER_TARGET" in \
                r.json()["detail"]
            # Job streams count towards the process's cap too: ten fit, the eleventh does not.
            with c.stream("GET", f"/jobs/{job['id']}/events") as first:
                assert first.status_code == 200
                extra = [c.stream("GET", f"/jobs/{job['id']}/events") for _ in range(9)]
                assert [e.__enter__().status_code for e in extra] == [200] * 9
                r = c.get(f"/jobs/{job['id']}/events")
                assert r.status_code == 503 and "TRAINYARD_MAX_EVENT_STREAMS" in r.json()["detail"]
                for e in extra:
                    e.__exit__(None, None, None)
    finally:
        loop.call_soon_threadsafe(stop.set)
        streams.join(timeout=30)
    # Closed streams give their slots back.
    with live.client() as c:
        live.wait_until(lambda: c.post(f"/sweeps/{made['id']}/cancel").status_code in (200, 409), 10, "cancel")
        with c.stream("GET", f"/sweeps/{made['id']}/events") as r:
            assert r.status_code == 200
            assert "event: end" in "".join(r.iter_text())


def test_posting_a_sweep_past_the_running_sweeps_cap_is_refused(tmp_path):
    svc = Service(tmp_path / "data", env={"TRAINYARD_MAX_RUNNING_SWEEPS": "1"}).start_server()
    body = {"job": tiny_job(), "method": "random", "max_trials": 2,
            "parameters": {"train.lr": {"type": "float", "low": 1e-3, "high": 0.1}}}
    try:
        with svc.client() as c:
            first = c.post("/sweeps", json=body)
            assert first.status_code == 201
            r = c.post("/sweeps", json=body)
            assert r.status_code == 409 and "TRAINYARD_MAX_RUNNING_SWEEPS" in r.json()["detail"]
            assert c.post(f"/sweeps/{first.json()['id']}/cancel").status_code == 200
            assert c.post("/sweeps", json=body).status_code == 201
    finally:
        svc.stop()


@pytest.mark.postgres
@pytest.mark.parametrize("now", ["succeeded", "queued"])
def test_a_cancel_that_loses_its_race_answers_with_the_job_as_it_is(tmp_path, now):
    """The job's row changes (a worker finishing it, or requeueing it) between the cancel's read and its write,
    on the real database: the cancel waits for that write and answers with what the job became."""
    with postgres_schema("cancel") as url:
        svc = Service(tmp_path / "data", url).start_server()
        try:
            job = svc.submit(tiny_job())
            engine = make_engine(url)
            with engine.connect() as conn:
                conn.execute(update(jobs).where(jobs.c.id == job["id"]).values(state="running", claim=1, attempt=1))
                conn.commit()
                # A worker's write, open: the row is locked until it commits.
                conn.execute(update(jobs).where(jobs.c.id == job["id"]).values(state=now))
                me = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
                answer = {}
                cancel = threading.Thread(
                    target=lambda: answer.update(r=svc.client().post(f"/jobs/{job['id']}/cancel")))
                cancel.start()
                with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as watch:
                    svc.wait_until(lambda: watch.execute("SELECT count(*) FROM pg_stat_activity WHERE %s = ANY("
                                                         "pg_blocking_pids(pid))", (me,)).fetchone()[0] == 1,
                                   30, "the cancel to wait for the row")
                conn.commit()
                cancel.join(timeout=30)
            engine.dispose()
            r = answer["r"]
            if now == "succeeded":
                assert r.status_code == 409 and "is succeeded" in r.json()["detail"], r.text
            else:  # requeued: still cancellable, and cancelled
                assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
            assert svc.job(job["id"])["state"] == ("succeeded" if now == "succeeded" else "cancelled")
        finally:
            svc.stop()
