"""The list benchmark (issue 40): GET /jobs?limit=50 and /healthz, as issue 12's targets were set, beside the figures
at release 99d61fa, with and without a fleet's history.

Run: `.venv/bin/python -m bench.list_page [--backend sqlite|postgres|both] [--processes 2] [--seconds 5]
[--in-process]` from the repository root.

Open loop (default): per backend and per data set, `trainyard serve --workers N` (default 2) on a fresh database
with one idle CPU worker and 500 queued jobs for device "cuda:9" (no worker takes them: a page of 50 is 50
queued items, each with a waiting_for), as bench/api.py builds them; the "fleet history" data set has, before
them, 50 projects with a member each and 200 ended jobs apiece (10,000 rows, ended within the last hour, as
retention keeps them for 30 days). Each endpoint runs at 200 requests/s open loop for --seconds (latency counts
from the scheduled send time: a saturated server shows as latency and as requests unanswered). The server's CPU
per request comes from /proc, the figure least disturbed by other load on the machine.

--in-process: the same data in this process, the app called through its ASGI interface (no HTTP, no load
generator): CPU per request and SQL statements per request, the figures that compare commits on a busy machine.
"""
import argparse
import asyncio
import json
import tempfile
import threading
import time
from contextlib import nullcontext
from pathlib import Path

from sqlalchemy import event, insert
from sqlalchemy.engine import Engine

from bench.api import RATE, RawHttp, fixed_rate, sender
from bench.common import TINY_JOB, CpuMeter, env_line, load_note, pct, postgres_schema, service, table, verdict
from trainyard.app import accounts
from trainyard.app.core.settings import Settings
from trainyard.app.db import jobs, make_engine

QUEUED, PROJECTS, ENDED = 500, 50, 200
TARGET_P99_MS = 20  # issue 12's target for GET /jobs?limit=50 at 200 requests/s, both backends
AT_99D61FA = {"SQLite": "p99 6-8 ms", "PostgreSQL": "p99 7.5 ms"}  # issue 12's release, this benchmark
BODY = {**TINY_JOB, "device": "cuda:9"}
PATHS = ("/jobs?limit=50", "/healthz")
# The threads app/duties/loops.py runs the server's duties in: their statements are not a request's.
BACKGROUND = {"lease-reaper", "collector", "preemption", "sweeps", "dependencies"}


def fleet_history(engine: Engine) -> None:
    """50 projects, a member each, 200 jobs apiece that ran and ended within the last hour."""
    now = time.time()
    for p in range(PROJECTS):
        project = accounts.add_project(engine, f"team{p}")
        accounts.add_user(engine, f"user{p}")
        accounts.add_member(engine, f"user{p}", f"team{p}")
        with engine.begin() as conn:
            conn.execute(insert(jobs), [dict(
                kind="train", state="succeeded", spec=TINY_JOB, device_req="cpu", priority=0, max_attempts=3,
                attempt=1, claim=1, created_at=now - 3600 + i, queued_at=now - 3600 + i, started_at=now - 3000 + i,
                finished_at=now - 2400 + i, epoch=1, epochs=1, errors=[], result={"val_acc": 0.9},
                latest_metrics={"epoch": 1, "val_acc": 0.9}, device="cpu", project_id=project["id"],
                owner=f"user{p}") for i in range(ENDED)])


def open_loop(backend: str, fleet: bool, processes: int, seconds: float) -> list[list]:
    with (postgres_schema() if backend == "PostgreSQL" else nullcontext("")) as url, \
            service(workers=1, processes=processes, database_url=url) as svc, svc.client() as c:
        if fleet:
            engine = make_engine(Settings(data_dir=svc.data_dir, database_url=url).db_url)
            fleet_history(engine)
            engine.dispose()
        for _ in range(QUEUED):
            c.post("/jobs", json=BODY).raise_for_status()
        assert c.get("/jobs", params={"limit": 50}).json()["count"] == QUEUED + (PROJECTS * ENDED if fleet else 0)
        assert svc.server is not None
        rows = []
        for path in PATHS:
            res, cpu = asyncio.run(_measure(sender(RawHttp(svc.url), "GET", path, 200), svc.server.pid, seconds))
            n = len(res["lat"]) + res["errors"].total()
            p50, p99 = 1000 * pct(res["lat"], 50), 1000 * pct(res["lat"], 99)
            answered = len(res["lat"]) / seconds
            ok = p99 if not res["errors"] else float("inf")
            rows.append([backend, "fleet history" if fleet else f"{QUEUED} queued", f"GET {path}", f"{RATE}/s",
                         f"{answered:.0f}", p50, p99, res["errors"].total(), f"{1000 * cpu['server'] / n:.2f}",
                         f"p99 <= {TARGET_P99_MS} ms: {verdict(ok, TARGET_P99_MS + 1e-9)}" if "jobs" in path else "",
                         AT_99D61FA[backend] if "jobs" in path and not fleet else ""])
    return rows


async def _measure(send, pid: int, seconds: float) -> tuple[dict, dict]:
    await fixed_rate(send, RATE, min(0.5, seconds))  # warm-up: connections, caches
    meter = CpuMeter({"server": pid})
    return await fixed_rate(send, RATE, seconds), meter.read()


def in_process(backend: str, fleet: bool, requests: int = 300) -> list[list]:
    """CPU and SQL statements per request, the app called in this process (see the module's docstring)."""
    from trainyard.app.api import create_app
    from trainyard.app.fleet import workers as registry

    counted = [0]

    def count(*_args) -> None:
        if threading.current_thread().name not in BACKGROUND:  # the request's, on the loop or in the thread pool
            counted[0] += 1
    event.listen(Engine, "before_cursor_execute", count)
    rows = []
    with (postgres_schema() if backend == "PostgreSQL" else nullcontext("")) as url, \
            tempfile.TemporaryDirectory() as tmp:
        app = create_app(Settings(data_dir=Path(tmp), database_url=url, api_token="bench", lease_s=3600))

        async def main() -> None:
            async with app.router.lifespan_context(app):
                if fleet:
                    fleet_history(app.state.engine)
                registry.register_worker(app.state.engine, "bench-cpu", "bench", 1, "cpu", {})
                for _ in range(QUEUED):
                    assert await asgi_call(app, "POST", "/jobs", BODY) == 201
                for path in (*PATHS, "/nothing-here"):
                    for _ in range(30):
                        await asgi_call(app, "GET", path)
                    counted[0] = 0
                    await asgi_call(app, "GET", path)
                    statements = counted[0]
                    t0 = time.process_time()
                    for _ in range(requests):
                        await asgi_call(app, "GET", path)
                    ms = 1000 * (time.process_time() - t0) / requests
                    rows.append([backend, "fleet history" if fleet else f"{QUEUED} queued", f"GET {path}",
                                 statements, f"{ms:.2f}"])
        asyncio.run(main())
    event.remove(Engine, "before_cursor_execute", count)
    return rows


async def asgi_call(app, method: str, path: str, body: dict | None = None) -> int:
    """One request through the app's ASGI interface, as uvicorn would make it (no HTTP client's CPU in the
    figure: httpx's ASGI transport cost about as much as a small route); its status."""
    data, status = json.dumps(body).encode() if body is not None else b"", []
    target, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": target, "raw_path": target.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(b"host", b"127.0.0.1:8000"), (b"authorization", b"Bearer bench"),
                         (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # the request has no more body: wait as a client would
        sent = True
        return {"type": "http.request", "body": data, "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
    await app(scope, receive, send)
    return status[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--processes", type=int, default=2, help="server processes (trainyard serve --workers N)")
    ap.add_argument("--seconds", type=float, default=5.0, help="open loop: seconds per endpoint")
    ap.add_argument("--in-process", action="store_true", help="CPU and statements per request, in this process")
    args = ap.parse_args()
    backends = {"sqlite": ["SQLite"], "postgres": ["PostgreSQL"], "both": ["SQLite", "PostgreSQL"]}[args.backend]
    print(env_line(" and ".join(backends)))
    if args.in_process:
        rows = [r for b in backends for fleet in (False, True) for r in in_process(b, fleet)]
        print("\nin process, through the ASGI interface (the 404 row: what any request costs)\n")
        print(table(["backend", "data", "request", "SQL statements", "CPU ms/request"], rows))
    else:
        rows = [r for b in backends for fleet in (False, True) for r in open_loop(b, fleet, args.processes,
                                                                                  args.seconds)]
        print(f"\n`serve --workers {args.processes}`, {args.seconds:g} s at {RATE} requests/s per row, open loop\n")
        print(table(["backend", "data", "endpoint", "offered", "answered/s", "p50 ms", "p99 ms", "errors",
                     "server CPU ms/req", "issue 12 target", "at 99d61fa"], rows))
    print(f"\nAt the end: {load_note()}.")


if __name__ == "__main__":
    main()
