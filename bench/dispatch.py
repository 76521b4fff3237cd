"""Dispatch benchmark: how fast an idle worker picks up a job, and how fast workers drain a queue.

Run: `.venv/bin/python -m bench.dispatch [--quick]` from the repository root.

1. Latency. `trainyard serve` plus one CPU worker on a fresh data dir (SQLite). Once the worker is
   registered and idle, N tiny jobs (MLP [8] on Iris, 1 epoch, no checkpoint) are submitted one at
   a time; each is submitted only after the previous one succeeded plus a random 50-100 ms pause, so
   the supervisor is back in its idle poll loop and the submit lands at a random phase of its poll
   timer. submit->running = started_at - created_at and submit->succeeded = finished_at - created_at,
   both stamped by the database's clock (SQLite's julianday('now'): 1 ms resolution).
2. Drain rate. For 1, 2 and 4 CPU workers (a fresh service each; the 1-worker drain reuses the
   latency test's service once its queue is empty), the workers are started and registered first,
   then M tiny jobs are POSTed back to back; rate = M / (last finished_at - first created_at),
   database clock. The machine has 2 cores, so scaling should flatten past 2 workers. Also shown:
   the median job's running->succeeded time, and the median turnaround (a worker's finished_at of
   one job to started_at of its next: the supervisor's own overhead between back-to-back jobs).

--quick: 5 latency jobs and a 6-job drain with 1 worker only (~15 s: a worker's fork server
imports torch before it registers, ~9 s on this machine).

The benchmark process polls GET /jobs/{id} (every 25 ms) while it waits, which costs the server a
little CPU on the same 2 cores; the figures themselves come from the database timestamps.
"""
import argparse
import os
import random
import time
from collections import Counter

from bench.common import TINY_JOB, env_line, iso_s, load_note, pct, service, table, verdict
from trainyard.app.states import TERMINAL, JobState

LATENCY_P50_MS, LATENCY_P99_MS = 50, 150


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: a few jobs, 1 worker only")
    ap.add_argument("-n", type=int, help="jobs in the latency test (default 100, 5 with --quick)")
    ap.add_argument("-m", type=int, help="jobs per drain run (default 60, 6 with --quick)")
    args = ap.parse_args()
    n = args.n or (5 if args.quick else 100)
    m = args.m or (6 if args.quick else 60)
    worker_counts = (1,) if args.quick else (1, 2, 4)
    assert m <= 500, "drain reads the jobs back from one page of GET /jobs"

    env = env_line()  # taken first: its load average is the one the run started with
    drains = {}
    for w in worker_counts:
        with service(workers=w) as svc, svc.client() as c:
            if w == 1:  # the latency test runs first, on the same fresh service as the 1-worker drain
                lat = latency(svc, c, n)
            drains[w] = drain(svc, c, m)

    run, done = lat["run"], lat["done"]
    rows = [
        ["submit->running p50 (ms)", pct(run, 50), f"< {LATENCY_P50_MS}", verdict(pct(run, 50), LATENCY_P50_MS)],
        ["submit->running p90 (ms)", pct(run, 90), "", ""],
        ["submit->running p99 (ms)", pct(run, 99), f"< {LATENCY_P99_MS}", verdict(pct(run, 99), LATENCY_P99_MS)],
        ["submit->running max (ms)", max(run), "", ""],
        ["submit->succeeded p50 (ms)", pct(done, 50), "", "information"],
        ["submit->succeeded p99 (ms)", pct(done, 99), "", "information"],
    ]
    base = drains[1]["rate"]
    for w, d in drains.items():
        rows.append([f"drain, {w} worker{'s' if w > 1 else ''} (jobs/s)", d["rate"], "",
                     f"{d['rate'] / base:.2f}x vs 1 worker; {m} jobs in {d['span']:.1f} s; per worker "
                     f"{d['per_worker']}; median running->succeeded {d['run_ms']:.0f} ms, "
                     f"turnaround {d['gap_ms']:.0f} ms; load average {d['load']:.1f} at start"])
    print(env)
    print(f"latency: {n} tiny jobs one at a time, 1 idle CPU worker; drain: {m} tiny jobs queued at once\n")
    print(table(["measure", "value", "target", "verdict / notes"], rows))
    print("\nAll times from the database clock (1 ms resolution). The worker, its job processes, the API server "
          f"and this benchmark's polling share the machine's cores. At the end: {load_note()}.")


if __name__ == "__main__":
    main()
