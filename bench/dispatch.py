"""Dispatch benchmark: how fast an idle worker picks up a job, what an idle worker costs, and how fast
workers drain a queue; on SQLite and PostgreSQL side by side.

Run: `.venv/bin/python -m bench.dispatch [--quick] [--backend sqlite|postgres|both]` from the
repository root (PostgreSQL: the local server's `test` database, a fresh schema per service).

1. Idle CPU. `trainyard serve` plus one CPU worker on a fresh data dir; once the worker is idle,
   the CPU its process uses over 20 s (heartbeats, and waiting for a wake-up: LISTEN/NOTIFY on
   PostgreSQL, a datagram on SQLite; the safety-net poll every poll_s), as a percent of one core.
2. Latency. On that service, N tiny jobs (MLP [8] on Iris, 1 epoch, no checkpoint) are submitted one
   at a time; each only after the previous one succeeded plus a random 50-100 ms pause, so that the
   worker is waiting again. submit->running = started_at - created_at and submit->succeeded =
   finished_at - created_at, both stamped by the database's clock (1 ms resolution on SQLite).
3. Drain rate. For 1, 2 and 4 CPU workers (a fresh service each; the 1-worker drain reuses the
   latency test's service once its queue is empty), the workers are started and registered first,
   then M tiny jobs are POSTed back to back; rate = M / (last finished_at - first created_at),
   database clock. The machine has 2 cores, so scaling should flatten past 2 workers. Also shown:
   the median job's running->succeeded time, and the median turnaround (a worker's finished_at of
   one job to started_at of its next: the supervisor's own overhead between back-to-back jobs).

--quick: 5 latency jobs, 3 s of idle CPU and a 6-job drain with 1 worker only.
--history: before the measurements, a fleet's history is written straight into the service's database
   (build_history: 50 projects with a member each, 200 jobs apiece that ran and ended within the last
   hour, 10,000 rows, as retention keeps them for 30 days); the measured jobs are the admin's.
--idle-s S: the idle worker's CPU over S seconds. The in-process cost of one claim and of one idle
   poll (CPU time and statements, both backends, with and without that history) is bench/claim_cost.py's.

The benchmark process polls GET /jobs/{id} (every 25 ms) while it waits, which costs the server a
little CPU on the same 2 cores; the figures themselves come from the database timestamps.
"""
import argparse
import os
import random
import time
from collections import Counter
from contextlib import nullcontext

from bench.claim_cost import build_history
from bench.common import TINY_JOB, CpuMeter, env_line, iso_s, load_note, pct, postgres_schema, service, table, verdict
from trainyard.app.core.states import TERMINAL, JobState

LATENCY_P50_MS, LATENCY_P99_MS = 20, 60
IDLE_CPU_PCT = 1.0


def latency(svc, c, n: int) -> dict:
    run_ms, done_ms = [], []
    for _ in range(n):
        time.sleep(random.uniform(0.05, 0.10))
        job = c.post("/jobs", json=TINY_JOB).raise_for_status().json()
        while job["state"] not in TERMINAL:
            time.sleep(0.025)
            job = c.get(f"/jobs/{job['id']}").raise_for_status().json()
        if job["state"] != JobState.SUCCEEDED:
            raise RuntimeError(f"job {job['id']} {job['state']}: {job['error']}\n{svc.output()}")
        created = iso_s(job["created_at"])
        run_ms.append(1000 * (iso_s(job["started_at"]) - created))
        done_ms.append(1000 * (iso_s(job["finished_at"]) - created))
    return {"run": run_ms, "done": done_ms}


def drain(svc, c, m: int) -> dict:
    load = os.getloadavg()[0]
    ids = {c.post("/jobs", json=TINY_JOB).raise_for_status().json()["id"] for _ in range(m)}
    deadline = time.monotonic() + 60 + 5 * m
    while True:
        page = c.get("/jobs", params={"limit": 500}).raise_for_status().json()["data"]
        jobs = [j for j in page if j["id"] in ids]
        if all(j["state"] in TERMINAL for j in jobs):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"queue not drained: {Counter(j['state'] for j in jobs)}\n{svc.output()}")
        time.sleep(0.25)
    bad = [j for j in jobs if j["state"] != JobState.SUCCEEDED]
    if bad:
        raise RuntimeError(f"{len(bad)} jobs did not succeed, e.g. {bad[0]['error']}")
    span = max(iso_s(j["finished_at"]) for j in jobs) - min(iso_s(j["created_at"]) for j in jobs)
    per_worker = sorted(Counter(j["worker_id"] for j in jobs).values(), reverse=True)
    runs = [1000 * (iso_s(j["finished_at"]) - iso_s(j["started_at"])) for j in jobs]
    gaps = []  # a worker's turnaround: its previous job's finished_at to its next job's started_at
    for w in {j["worker_id"] for j in jobs}:
        mine = sorted((iso_s(j["started_at"]), iso_s(j["finished_at"])) for j in jobs if j["worker_id"] == w)
        gaps += [1000 * (b[0] - a[1]) for a, b in zip(mine, mine[1:])]
    return {"rate": m / span, "span": span, "per_worker": per_worker, "run_ms": pct(runs, 50),
            "gap_ms": pct(gaps, 50) if gaps else float("nan"), "load": load}


def idle_cpu(svc, seconds: float) -> float:
    """Percent of one core an idle worker process uses (its supervisor: heartbeats, waiting for work)."""
    pid = svc.workers[0].pid
    time.sleep(1.0)  # let the last job's bookkeeping settle
    meter = CpuMeter({"worker": pid})
    time.sleep(seconds)
    used = meter.read()
    return 100 * used["worker"] / used["wall"]


def run_backend(backend: str, n: int, m: int, worker_counts, idle_s: float, history: bool = False) -> dict:
    out: dict = {"drains": {}}
    for w in worker_counts:  # a fresh service, data dir and database (schema) each
        with (postgres_schema() if backend == "PostgreSQL" else nullcontext("")) as url, \
                service(workers=w, database_url=url) as svc, svc.client() as c:
            if history:
                build_history(url or f"sqlite:///{svc.data_dir.resolve() / 'trainyard.db'}")
            if w == 1:  # latency and idle CPU on the same fresh service as the 1-worker drain
                out["idle"] = idle_cpu(svc, idle_s)
                out["lat"] = latency(svc, c, n)
            out["drains"][w] = drain(svc, c, m)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: a few jobs, 1 worker only")
    ap.add_argument("-n", type=int, help="jobs in the latency test (default 100, 5 with --quick)")
    ap.add_argument("-m", type=int, help="jobs per drain run (default 60, 6 with --quick)")
    ap.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--history", action="store_true",
                    help="a fleet's history in each database first: 50 projects x 200 jobs ended in the last hour")
    ap.add_argument("--idle-s", type=float, help="seconds the idle worker's CPU is measured over (default 20, 3 "
                                                 "with --quick)")
    args = ap.parse_args()
    n = args.n or (5 if args.quick else 100)
    m = args.m or (6 if args.quick else 60)
    worker_counts = (1,) if args.quick else (1, 2, 4)
    idle_s = args.idle_s or (3.0 if args.quick else 20.0)
    assert m <= 500, "drain reads the jobs back from one page of GET /jobs"
    backends = {"sqlite": ["SQLite"], "postgres": ["PostgreSQL"], "both": ["SQLite", "PostgreSQL"]}[args.backend]

    env = env_line(" and ".join(backends))  # taken first: its load average is the one the run started with
    res = {b: run_backend(b, n, m, worker_counts, idle_s, args.history) for b in backends}

    def row(name, values, target="", check=None):
        verdicts = [verdict(v, check) for v in values] if check is not None else []
        return [name, *[f"{v:.1f}" if isinstance(v, float) else v for v in values], target, " / ".join(verdicts)]

    rows = []
    for q, target in ((50, LATENCY_P50_MS), (90, None), (99, LATENCY_P99_MS)):
        rows.append(row(f"submit->running p{q} (ms)", [pct(res[b]["lat"]["run"], q) for b in backends],
                        f"<= {target}" if target else "", target))
    rows.append(row("submit->running max (ms)", [max(res[b]["lat"]["run"]) for b in backends]))
    rows.append(row("submit->succeeded p50 (ms)", [pct(res[b]["lat"]["done"], 50) for b in backends]))
    rows.append(row("idle worker CPU (% of a core)", [res[b]["idle"] for b in backends], f"< {IDLE_CPU_PCT}",
                    IDLE_CPU_PCT))
    for w in worker_counts:
        rows.append(row(f"drain, {w} worker{'s' if w > 1 else ''} (jobs/s)",
                        [res[b]["drains"][w]["rate"] for b in backends]))
    notes = []
    for b in backends:
        base = res[b]["drains"][1]["rate"]
        for w, d in res[b]["drains"].items():
            notes.append(f"{b}, {w} worker(s): {d['rate'] / base:.2f}x vs 1 worker; {m} jobs in {d['span']:.1f} s; "
                         f"per worker {d['per_worker']}; median running->succeeded {d['run_ms']:.0f} ms, "
                         f"turnaround {d['gap_ms']:.0f} ms; load average {d['load']:.1f} at start")
    print(env)
    print(f"latency: {n} tiny jobs one at a time, 1 idle CPU worker; idle CPU: that worker over {idle_s:.0f} s "
          f"with nothing queued; drain: {m} tiny jobs queued at once"
          f"{'; with a history of 50 projects x 200 ended jobs' if args.history else ''}\n")
    print(table(["measure", *backends, "target", "verdict"], rows))
    print("\n" + "\n".join(f"- {line}" for line in notes))
    print("\nAll times from the database clock (1 ms resolution). The worker, its job processes, the API server "
          f"and this benchmark's polling share the machine's cores. At the end: {load_note()}.")


if __name__ == "__main__":
    main()
