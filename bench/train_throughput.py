"""Training throughput: the service against hand-written PyTorch loops, same model, data and spec.

`python -m bench.train_throughput [--rounds N] [--quick] [--device cuda:0] [--cases iris-mlp,...]
[--threads 1,2] [--loops tight,seed000]` starts the real service (server + one worker on the device, the CPU by default;
SQLite) and, for each case, interleaves service jobs with the hand-written loops of bench/loops.py
on the same device (each in a process of its own, like the service's job process), N rounds, the
order rotated every round so that each runner takes every place in turn.

On the CPU every hand-written loop runs at each torch thread count of --threads (default 1 up to the
cores this process may use) and is compared at its best one, the count the table reports; the
service picks its own (worker/torch_devices.fit_cpu_threads), also reported. On a GPU the loops run
at torch's default count.

Throughput counts training steps only, for all: samples / training seconds over every epoch but
the first (warm-up), evaluation and checkpoints excluded. For the service it comes from the job's
own per-epoch metrics. The service's end-to-end time (submit to succeeded, including process start,
data loading, per-epoch evaluation, metrics, checkpoints and the artifact) is shown beside it.
The targets (bench/cases.py TARGETS, issue 23) are ratios of the medians.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.cases import CASES, TARGETS, YARDSTICKS
from bench.common import PROD_ENV, ROOT, iso_s, load_note
from bench.loops import numerics
from trainyard.app.launcher import Service
from trainyard.app.states import TERMINAL, JobState

SERVICE = "service"
POLL_S = 0.5
Runner = tuple[str, int | None]  # (SERVICE or a loop of bench/loops.py, torch threads; None: the default)


def rate(seconds: list[float], samples: int) -> float:
    steady = seconds[1:] or seconds
    return samples * len(steady) / sum(steady)


def run_service(svc: Service, case: str | dict, epochs: int | None,
                device: str = "cpu") -> tuple[float, float, int | None]:
    """(samples/s, submit-to-succeeded seconds, the job's CPU threads) of one job: a case of
    bench/cases.py, or a spec."""
    spec = {**json.loads(json.dumps(CASES[case] if isinstance(case, str) else case)), "device": device}
    if epochs:
        spec["train"]["epochs"] = epochs
    with svc.client() as c:
        job = svc.submit(spec)
        deadline = time.monotonic() + 1800
        while job["state"] not in TERMINAL and time.monotonic() < deadline:
            # Slowly: the server answering a poll takes CPU from the job it measures (the loops' runs
            # have no poller beside them); the end-to-end time comes from the database's clock.
            time.sleep(POLL_S)
            job = c.get(f"/jobs/{job['id']}").json()
        assert job["state"] == JobState.SUCCEEDED, job
        wall = iso_s(job["finished_at"]) - iso_s(job["created_at"])
        history = c.get(f"/jobs/{job['id']}/metrics").json()
    applied = (job.get("result") or {}).get("applied") or {}
    NUMERICS_SEEN[(SERVICE, spec["device"])] = numerics(applied)
    # Every epoch trains on the same samples, so seconds per sample stand in for seconds per epoch.
    return rate([1.0 / m["samples_per_s"] for m in history], 1), wall, applied.get("cpu_threads")


def run_loop(case: str, loop: str, epochs: int, data_dir: Path, device: str = "cpu",
             threads: int | None = None) -> float:
    args = [case, loop, str(epochs), str(data_dir), device] + ([str(threads)] if threads else [])
    out = subprocess.run([sys.executable, "-m", "bench.loops", *args],
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=1800)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    NUMERICS_SEEN[(loop, device)] = res["numerics"]
    return rate(res["seconds"], res["samples"])


# Each runner's numerics (bench/loops.py numerics()), as last seen: printed beside the table, side by side.
NUMERICS_SEEN: dict[tuple[str, str], str] = {}


def thread_counts(device: str, asked: str | None) -> list[int | None]:
    """The torch thread counts each loop is tried at: --threads, or 1 up to this process's cores on the CPU."""
    if asked:
        return [int(n) for n in asked.split(",")]
    if device != "cpu":
        return [None]
    return list(range(1, len(os.sched_getaffinity(0)) + 1))


def runners(case: str, loops: list[str], counts: list[int | None], r: int) -> list[Runner]:
    """Who runs in round r, in which order: the service and every loop at every count, rotated by r."""
    order: list[Runner] = [(SERVICE, None)] + [(loop, n) for loop in loops for n in counts]
    shift = r % len(order)
    return order[shift:] + order[:shift]


def measure(svc: Service, cases: dict[str, list[str]], rounds: int, quick: bool, device: str,
            counts: list[int | None]) -> tuple[dict, dict, dict]:
    """Every runner's samples/s per round, the service's end-to-end seconds and its thread count per case."""
    results: dict[tuple[str, Runner], list[float]] = {}
    walls: dict[str, list[float]] = {}
    service_threads: dict[str, int | None] = {}
    for r in range(rounds):
        for case, loops in cases.items():
            epochs = 2 if quick else CASES[case]["train"]["epochs"]
            for name, threads in runners(case, loops, counts, r):
                if name == SERVICE:
                    value, wall, service_threads[case] = run_service(svc, case, epochs, device)
                    walls.setdefault(case, []).append(wall)
                else:
                    value = run_loop(case, name, epochs, svc.data_dir, device, threads)
                results.setdefault((case, (name, threads)), []).append(value)
                at = f"@{threads}" if threads else ""
                print(f"  round {r + 1} {case:14} {name + at:10} {value:10.0f} samples/s", file=sys.stderr)
    return results, walls, service_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one round of short runs (a smoke test)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda:N: the worker's, and the loops'")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--threads", help="comma-separated torch thread counts to try the loops at "
                    "(default on the CPU: 1 up to the cores)")
    ap.add_argument("--loops", help="comma-separated: only these of each case's yardsticks (default: all)")
    args = ap.parse_args()
    if unknown := set(args.cases.split(",")) - set(CASES):
        ap.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    only = set(args.loops.split(",")) if args.loops else None
    cases = {case: [loop for loop in YARDSTICKS[case] if only is None or loop in only]
             for case in args.cases.split(",")}
    rounds = 1 if args.quick else args.rounds
    counts = thread_counts(args.device, args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="trainyard-bench-"))
    svc = Service.isolated(tmp / "data", env=PROD_ENV).start_server()
    svc.start_worker(args.device)
    try:
        results, walls, service_threads = measure(svc, cases, rounds, args.quick, args.device, counts)
    finally:
        svc.stop()
    print(f"\n{os.cpu_count()} cores, torch {torch.__version__}, device {args.device}, {datetime.date.today()}, "
          f"median of {rounds} interleaved round(s), loops at their best of threads {counts}, {load_note()}\n")
    print_table(results, walls, service_threads, cases)
    print("\nNumerics, each side as it ran (the loops apply the service's own switches for the spec):")
    for (runner, device), seen in sorted(NUMERICS_SEEN.items()):
        print(f"- {runner} on {device}: {seen}")


def print_table(results: dict, walls: dict, service_threads: dict, cases: dict[str, list[str]]) -> None:
    """One row per (case, yardstick): the yardstick at its best thread count; the columns bench/gpu_check
    reads (case, yardstick, ratio) stay at 0, 2 and 4."""
    med = {k: statistics.median(v) for k, v in results.items()}
    print("| case | service samples/s | yardstick | yardstick samples/s | service / yardstick | target "
          "| rounds' ratios | yardstick threads | service threads | service end-to-end s |")
    print("|---|---:|---|---:|---:|---|---|---:|---:|---:|")
    for case, loops in cases.items():
        s = med[(case, (SERVICE, None))]
        for loop in loops:
            tried = {n: v for (c, (name, n)), v in med.items() if c == case and name == loop}
            best = max(tried, key=lambda n: tried[n])
            y, target = tried[best], TARGETS.get((case, loop))
            verdict = "-" if target is None else f">= {target:.2f}x: {'met' if s / y >= target else 'NOT met'}"
            # Round by round, the service against the loop at that best count: how much the ratio moves.
            each = [a / b for a, b in zip(results[(case, (SERVICE, None))], results[(case, (loop, best))])]
            print(f"| {case} | {s:,.0f} | {loop} | {y:,.0f} | {s / y:.3f}x | {verdict} | "
                  f"{min(each):.2f}-{max(each):.2f} | {best or 'default'} | "
                  f"{service_threads.get(case) or '-'} | {statistics.median(walls[case]):.2f} |")


if __name__ == "__main__":
    main()
