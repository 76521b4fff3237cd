"""Sweep benchmark: what running trials through a sweep costs over submitting the same jobs by hand.

Run: `.venv/bin/python -m bench.sweep [--rounds 5] [--workers 2] [--trials 20]` from the repository root.

One service for the whole run (`trainyard serve` plus --workers CPU workers on a fresh data dir,
SQLite, production timings), warmed by one job. Then, --rounds times, in alternating order, the
same N tiny Iris jobs (MLP [8], 3 epochs, no checkpoints; N learning rates, log-spaced 1e-3..1e-1):
1. `by hand`: the N jobs POSTed to /jobs back to back; done when all have ended. What a script
   that loops over the values does: the queue holds all N at once and the workers drain it.
2. `sweep, max_concurrent = workers`: POST /sweeps with method "grid" over {"train.lr": choice of the
   N values}, max_trials N, no pruner; done when the sweep has ended. The sweep keeps only as many
   trials queued or running as there are workers, so each trial's job is made when an earlier one
   ends: this is the case that pays the sweep's scheduling (noticing the end, recording the value in
   the study, asking for the next values, inserting the job) once per trial.
3. `sweep, max_concurrent = N`: the same sweep allowed to queue all N trials at once, as by hand.

Wall time is this process's clock from the first POST to seeing the end (it polls every 50 ms on
both sides, so the polling error is the same); the ratio and the per-trial overhead
((sweep wall - hand wall) / N) are taken within each round, then the median over rounds. From the
database clock, per case: the median job's queue wait (created -> started) and run time
(started -> finished), and for sweeps the median slot refill: a trial's job created_at minus the
finished_at of the job whose end freed its slot (the sweep's reaction time; the hand-submitted queue
has none).
"""
import argparse
import statistics
import time
from collections import Counter
from typing import cast

from bench.common import TINY_JOB, env_line, iso_s, load_note, pct, service, table
from trainyard.app.core.states import TERMINAL, JobState

POLL_S = 0.05


def lrs(n: int) -> list[float]:
    return [round(10 ** (-3 + 2 * i / max(1, n - 1)), 6) for i in range(n)]


def job(lr: float | None = None) -> dict:
    train = {**cast(dict, TINY_JOB["train"]), "epochs": 3, **({"lr": lr} if lr is not None else {})}
    return {**TINY_JOB, "name": "bench-sweep", "train": train}


def jobs_by_id(c, ids: set[int]) -> list[dict]:
    page = c.get("/jobs", params={"limit": 500}).raise_for_status().json()["data"]
    return [j for j in page if j["id"] in ids]


def by_hand(svc, c, values: list[float]) -> dict:
    t0 = time.monotonic()
    ids = {c.post("/jobs", json=job(lr)).raise_for_status().json()["id"] for lr in values}
    deadline = t0 + 120 + 10 * len(values)
    while True:
        jobs = jobs_by_id(c, ids)
        if len(jobs) == len(ids) and all(j["state"] in TERMINAL for j in jobs):
            wall = time.monotonic() - t0
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"jobs not done: {Counter(j['state'] for j in jobs)}\n{svc.output()}")
        time.sleep(POLL_S)
    return {"wall": wall, **job_stats(jobs)}


def by_sweep(svc, c, values: list[float], concurrent: int) -> dict:
    spec = {"name": f"bench-sweep-{concurrent}", "job": job(), "method": "grid",
            "parameters": {"train.lr": {"type": "choice", "values": values}},
            "metric": "val_loss", "max_trials": len(values), "max_concurrent": concurrent, "pruner": None}
    t0 = time.monotonic()
    r = c.post("/sweeps", json=spec)
    if r.status_code != 201:
        raise RuntimeError(f"POST /sweeps: {r.status_code} {r.text}")
    sweep_id = r.json()["id"]
    deadline = t0 + 120 + 10 * len(values)
    while True:
        sweep = c.get(f"/sweeps/{sweep_id}").raise_for_status().json()
        if sweep["state"] in TERMINAL:
            wall = time.monotonic() - t0
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"sweep {sweep_id} still {sweep['state']}: {sweep['counts']}\n{svc.output()}")
        time.sleep(POLL_S)
    if sweep["state"] != JobState.SUCCEEDED or sweep["trial_count"] != len(values):
        raise RuntimeError(f"sweep {sweep_id} {sweep['state']} after {sweep['trial_count']} trials: {sweep['error']}")
    jobs = jobs_by_id(c, {t["job_id"] for t in sweep["trials"]})
    stats = job_stats(jobs)
    # The k-th job made (k >= concurrent) took the slot of the (k - concurrent)-th job to end.
    made = sorted(iso_s(j["created_at"]) for j in jobs)
    ended = sorted(iso_s(j["finished_at"]) for j in jobs)
    refills = [1000 * (made[k] - ended[k - concurrent]) for k in range(concurrent, len(made))]
    return {"wall": wall, **stats, "refill_ms": pct(refills, 50) if refills else None,
            "db_span": iso_s(sweep["finished_at"]) - iso_s(sweep["created_at"])}


def job_stats(jobs: list[dict]) -> dict:
    bad = [j for j in jobs if j["state"] != JobState.SUCCEEDED]
    if bad:
        raise RuntimeError(f"{len(bad)} jobs did not succeed, e.g. {bad[0]['error']}")
    return {"wait_ms": pct([1000 * (iso_s(j["started_at"]) - iso_s(j["created_at"])) for j in jobs], 50),
            "run_ms": pct([1000 * (iso_s(j["finished_at"]) - iso_s(j["started_at"])) for j in jobs], 50),
            "db_span": max(iso_s(j["finished_at"]) for j in jobs) - min(iso_s(j["created_at"]) for j in jobs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--trials", type=int, default=20)
    args = ap.parse_args()
    n, w = args.trials, args.workers
    assert n <= 200, "the jobs are read back from one page of GET /jobs"
    values = lrs(n)
    cases = {"by hand": lambda svc, c: by_hand(svc, c, values),
             f"sweep, max_concurrent {w} (= workers)": lambda svc, c: by_sweep(svc, c, values, w),
             f"sweep, max_concurrent {n}": lambda svc, c: by_sweep(svc, c, values, n)}

    env = env_line()  # taken first: its load average is the one the run started with
    results: dict[str, list[dict]] = {name: [] for name in cases}
    with service(workers=w) as svc, svc.client() as c:
        by_hand(svc, c, values[:w])  # warm-up: each worker's first job
        for r in range(args.rounds):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for name in order:
                results[name].append(cases[name](svc, c))

    hand = results["by hand"]
    rows = []
    for name, runs in results.items():
        ratios = [x["wall"] / h["wall"] for x, h in zip(runs, hand)]
        ratio = f"{statistics.median(ratios):.2f}x"
        if len(runs) > 1:
            ratio += f" ({min(ratios):.2f}-{max(ratios):.2f})"
        over = statistics.median(1000 * (x["wall"] - h["wall"]) / n for x, h in zip(runs, hand))
        refill = [x["refill_ms"] for x in runs if x.get("refill_ms") is not None]
        rows.append([name, f"{statistics.median(x['wall'] for x in runs):.2f}",
                     f"{statistics.median(x['db_span'] for x in runs):.2f}",
                     "1" if name == "by hand" else ratio, "-" if name == "by hand" else f"{over:+.0f}",
                     f"{statistics.median(x['wait_ms'] for x in runs):.0f}",
                     f"{statistics.median(x['run_ms'] for x in runs):.0f}",
                     f"{statistics.median(refill):.0f}" if refill else "-"])
    print(f"\n{env}")
    print(f"{n} Iris jobs (MLP [8], 3 epochs) on {w} CPU workers; {args.rounds} rounds in alternating order, "
          "medians over rounds\n")
    print(table(["case", "wall (s)", "database span (s)", "wall / by hand", "overhead per trial (ms)",
                 "job queue wait p50 (ms)", "job run p50 (ms)", "slot refill p50 (ms)"], rows))
    print("\nwall: this process's clock, first POST to the end seen (50 ms polls); database span: first job "
          "created (the sweep's created_at) to the last finished; the ratio (median, and the rounds' range) and the "
          f"overhead are paired within each round. At the end: {load_note()}.")


if __name__ == "__main__":
    main()
