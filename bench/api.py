"""API benchmark: requests/s and latency of the main endpoints, beside a bare FastAPI app as the ceiling.

Run: `.venv/bin/python -m bench.api [--quick] [--processes N] [--backend sqlite|postgres|both]` from the
repository root.

Setup, per backend (default: both, one after the other in one run): `trainyard serve` on a fresh data
dir and a fresh database (a SQLite file, or a schema of its own in the local PostgreSQL) plus one CPU
worker, so that GET /devices reports a worker as in a real deployment and GET /jobs/{id} reads a job
that really ran (state, times, latest metrics, result). The worker stays idle, waiting to be woken by a
queue change as it would in production. The database is preloaded with 500 queued jobs for device
"cuda:9", which no worker takes, so GET /jobs?limit=50 pages through realistic rows. Beside it,
bench/bare_app.py runs in its own uvicorn process with the same uvicorn settings: GET /bare (async def)
is the ceiling, and GET /bare-sync (a plain def route, run in the thread pool like every trainyard
route) shows the thread hop's share.

Per endpoint, after a 0.5 s warm-up, two modes (the load generator is this process: asyncio and a
minimal keep-alive HTTP/1.1 client with a connection pool, RawHttp below):
 (a) fixed rate: 200 req/s open loop for 5 s; requests are sent on schedule whether or not earlier
     ones have answered, and latency counts from the scheduled send time, so a slow server (or a
     late load generator) shows up as latency rather than as less load.
 (b) max throughput: 8 concurrent clients in a closed loop for 5 s; for a trainyard endpoint, between
     two 2.5 s runs of the bare ceiling, whose mean its ratio is taken against.
POST /jobs (device "cuda:9", never claimed) runs last, since it grows the table.

--quick: 0.5 s per mode, 20 preloaded jobs (~20 s in all: the worker's fork server imports torch).

The list and /healthz alone, against issue 12's target and the figures at 99d61fa, with and without a fleet's
history, and their CPU and SQL statements per request in process: bench/list_page.py.
"""
import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
from functools import partial

import httpx

from bench.common import ROOT, TINY_JOB, CpuMeter, env_line, load_note, pct, postgres_schema, service, table, verdict
from trainyard.app.client.http import tls
from trainyard.app.core.states import JobState
from trainyard.app.launcher import free_port

RATE, CONCURRENCY = 200, 8
READ_P99_MS, READ_RATIO = 20, 0.5
POST_BODY = {**TINY_JOB, "device": "cuda:9"}


class RawHttp:
    """A minimal HTTP/1.1 keep-alive client over asyncio streams, with a pool of up to `limit`
    connections. httpx.AsyncClient spends several times more CPU per request, CPU the servers under
    test need on this 2-core machine. Enough for these servers: every response has a Content-Length."""

    KEEP_ALIVE_S = 4.0  # uvicorn closes a connection idle for 5 s: never reuse one that old

    def __init__(self, url: str, limit: int = 64):
        self.host, self.port = url.removeprefix("http://").split(":")
        self.idle: list = []  # (reader, writer, last used)
        self.slots = asyncio.Semaphore(limit)

    async def _connection(self):
        now = time.monotonic()
        while self.idle:
            r, w, used = self.idle.pop()
            if now - used < self.KEEP_ALIVE_S and not r.at_eof():
                return r, w
            w.close()
        return await asyncio.open_connection(self.host, int(self.port))

    async def request(self, method: str, path: str, body: bytes = b"") -> int:
        async with self.slots:
            r, w = await self._connection()
            try:
                async with asyncio.timeout(10):
                    w.write(f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                            + body)
                    head = await r.readuntil(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                    await r.readexactly(length)
            except BaseException:
                w.close()
                raise
            self.idle.append((r, w, time.monotonic()))
            return int(head[9:12])


def sender(http: RawHttp, method: str, path: str, status: int,
           body: dict | None = None) -> Callable[[], Awaitable[str | None]]:
    data = json.dumps(body).encode() if body is not None else b""

    async def send() -> str | None:
        """None on success, else what went wrong (an unexpected status, or the exception's name)."""
        try:
            got = await http.request(method, path, data)
            return None if got == status else f"HTTP {got}"
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError, TimeoutError) as exc:
            return type(exc).__name__
    return send


async def fixed_rate(send, rate: float, seconds: float) -> dict:
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    errors: Counter[str] = Counter()

    async def one(due: float) -> None:
        error = await send()
        if error is None:
            lat.append(loop.time() - due)
        else:
            errors[error] += 1

    t0 = loop.time() + 0.01
    tasks = []
    for i in range(int(rate * seconds)):
        due = t0 + i / rate
        await asyncio.sleep(max(0.0, due - loop.time()))
        tasks.append(asyncio.create_task(one(due)))
    await asyncio.gather(*tasks)
    return {"rate": len(tasks) / (loop.time() - t0), "lat": lat, "errors": errors}


async def closed_loop(send, clients: int, seconds: float) -> dict:
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    errors: Counter[str] = Counter()
    t0 = loop.time()
    end = t0 + seconds

    async def client():
        while loop.time() < end:
            start = loop.time()
            error = await send()
            if error is None:
                lat.append(loop.time() - start)
            else:
                errors[error] += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    return {"rate": (len(lat) + errors.total()) / (loop.time() - t0), "lat": lat, "errors": errors}


async def measure(endpoints, pids: dict, seconds: float, bare_url: str) -> list[dict]:
    """Each endpoint at the fixed rate, then flat out. A trainyard endpoint's flat-out run is bracketed
    by two runs of the bare ceiling (half as long each), and its ratio is taken against their mean: this
    machine's speed drifts by a quarter over minutes, and a ceiling measured minutes apart skewed it."""
    clients: dict[str, RawHttp] = {}

    def send_to(url: str, method: str = "GET", status: int = 200, body: dict | None = None):
        base, path = url.split("/", 3)[2], "/" + url.split("/", 3)[3]
        return sender(clients.setdefault(base, RawHttp(f"http://{base}")), method, path, status, body)

    bare = send_to(f"{bare_url}/bare")
    out = []
    for name, server, method, url, status, body in endpoints:
        send = send_to(url, method, status, body)
        await closed_loop(send, CONCURRENCY, min(0.5, seconds))  # warm-up: connections, caches
        for mode, run in (("fixed", partial(fixed_rate, send, RATE, seconds)),
                          ("max", partial(closed_loop, send, CONCURRENCY, seconds))):
            bracket = mode == "max" and server != "bare"
            before = (await closed_loop(bare, CONCURRENCY, seconds / 2))["rate"] if bracket else None
            meter = CpuMeter({"server": pids[server], "worker": pids["worker"]})
            res = await run()
            row = {"name": name, "mode": mode, **res, "cpu": meter.read()}
            if bracket:
                row["ceiling"] = (before + (await closed_loop(bare, CONCURRENCY, seconds / 2))["rate"]) / 2
            out.append(row)
    return out


def run_backend(backend: str, args, seconds: float, preload: int, bare_url: str, bare_pid: int,
                measure_bare: bool) -> list[dict]:
    """One service on this backend (a fresh SQLite file, or a fresh PostgreSQL schema), loaded, measured."""
    with (postgres_schema() if backend == "PostgreSQL" else nullcontext("")) as url, \
            service(workers=1, processes=args.processes, database_url=url) as svc, svc.client() as c:
        job = c.post("/jobs", json=TINY_JOB).raise_for_status().json()
        if svc.wait_state(job["id"])["state"] != JobState.SUCCEEDED:
            raise RuntimeError(f"the tiny job failed:\n{svc.output()}")
        for _ in range(preload):
            c.post("/jobs", json=POST_BODY).raise_for_status()
        assert len(c.get("/jobs", params={"limit": 50}).json()["data"]) == min(50, preload + 1)
        svc.wait_until(lambda: _up(f"{bare_url}/bare"), 30, "the bare app")
        endpoints: list[tuple[str, str, str, str, int, dict | None]] = [  # name, server, method, url, status, body
            ("bare FastAPI GET /bare (ceiling)", "bare", "GET", f"{bare_url}/bare", 200, None),
            ("bare FastAPI GET /bare-sync", "bare", "GET", f"{bare_url}/bare-sync", 200, None),
        ] if measure_bare else []
        endpoints += [
            (f"GET /jobs/{job['id']}", "server", "GET", f"{svc.url}/jobs/{job['id']}", 200, None),
            ("GET /jobs?limit=50", "server", "GET", f"{svc.url}/jobs?limit=50", 200, None),
            ("GET /devices", "server", "GET", f"{svc.url}/devices", 200, None),
            ("POST /jobs", "server", "POST", f"{svc.url}/jobs", 201, POST_BODY),
        ]
        assert svc.server is not None  # service() started it
        pids = {"bare": bare_pid, "server": svc.server.pid, "worker": svc.workers[0].pid}
        results = asyncio.run(measure(endpoints, pids, seconds, bare_url))
    return [{**r, "backend": "" if r["name"].startswith("bare") else backend} for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 0.5 s per mode, 20 preloaded jobs")
    ap.add_argument("--processes", type=int, default=1, help="server processes (trainyard serve --workers N)")
    ap.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    args = ap.parse_args()
    seconds, preload = (0.5, 20) if args.quick else (5.0, 500)
    backends = {"sqlite": ["SQLite"], "postgres": ["PostgreSQL"], "both": ["SQLite", "PostgreSQL"]}[args.backend]

    env = env_line(" and ".join(backends))  # taken first: its load average is the one the run started with
    bare_port = free_port()
    bare = subprocess.Popen([sys.executable, "-m", "bench.bare_app", str(bare_port)], cwd=ROOT)
    try:
        results = []
        for i, backend in enumerate(backends):
            results += run_backend(backend, args, seconds, preload, f"http://127.0.0.1:{bare_port}", bare.pid,
                                   measure_bare=i == 0)
    finally:
        bare.terminate()
        bare.wait(timeout=10)

    ceiling = next(r["rate"] for r in results if r["mode"] == "max" and r["name"].startswith("bare FastAPI GET /bare "))
    rows = []
    for r in results:
        p50, p99 = 1000 * pct(r["lat"], 50), 1000 * pct(r["lat"], 99)
        read = r["name"].startswith("GET")
        if r["mode"] == "fixed":
            offered, ratio = f"{RATE}/s open loop", ""
            ok_p99 = p99 if not r["errors"] else float("inf")  # errors fail the target too
            target = f"p99 < {READ_P99_MS} ms: {verdict(ok_p99, READ_P99_MS)}" if read else ""
        else:
            top = r.get("ceiling", ceiling)  # the bare runs bracketing this one, where there were
            offered, ratio = f"{CONCURRENCY} clients", f"{r['rate'] / top:.2f}x"
            target = f">= {READ_RATIO}x bare: {verdict(r['rate'] / top, READ_RATIO, below=False)}" if read else ""
        cpu, n = r["cpu"], len(r["lat"]) + r["errors"].total()
        errors = ", ".join(f"{k} x{v}" for k, v in r["errors"].most_common()) or "0"
        busy = " / ".join(f"{100 * cpu[k] / cpu['wall']:.0f}" for k in ("server", "loadgen", "worker"))
        rows.append([r["backend"], r["name"], offered, r["rate"], p50, p99, errors, ratio,
                     f"{1000 * cpu['server'] / n:.2f}", busy, target])
    print(env)
    print(f"{preload} preloaded jobs; {seconds:g} s per mode; {args.processes} server process(es); server and load "
          "generator are separate processes; the bare app runs in one process\n")
    print(table(["backend", "endpoint", "load", "req/s", "p50 ms", "p99 ms", "errors", "vs bare max (bracketing)",
                 "server CPU ms/req", "CPU % server / loadgen / worker", "target"], rows))
    print("\nThe load generator (this process), the server under test and the idle worker share the machine's "
          f"{os.cpu_count()} cores, so max-throughput figures are a lower bound for each server: 'CPU %' "
          f"(100 = one core busy) shows who was busy. The server runs {args.processes} process(es), each at most "
          "about one core's worth of Python. 'server CPU ms/req' (the server processes' CPU time over requests "
          "served) is the figure least disturbed by other load on the machine. Fixed-rate latency counts from the "
          "scheduled send time. Each trainyard endpoint's flat-out rate is compared with the bare ceiling measured "
          "just before and just after it (their mean). "
          f"At the end: {load_note()}.")


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1, verify=tls()).status_code == 200
    except httpx.TransportError:
        return False


if __name__ == "__main__":
    main()
