"""Training throughput: the service against hand-written PyTorch loops, same model, data and spec.

`python -m bench.train_throughput [--rounds N] [--quick] [--device cuda:0] [--cases iris-mlp,...]`
starts the real service (server + one worker on the device, the CPU by default; SQLite) and, for
each case, alternates service jobs with the hand-written loops of bench/loops.py on the same device
(each in a process of its own, like the service's job process), N rounds.

Throughput counts training steps only, for all: samples / training seconds over every epoch but
the first (warm-up), evaluation and checkpoints excluded. For the service it comes from the job's
own per-epoch metrics. The service's end-to-end time (submit to succeeded, including process start,
data loading, per-epoch evaluation, metrics, checkpoints and the artifact) is shown beside it.
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

from bench.cases import CASES, YARDSTICKS
from bench.common import PROD_ENV, ROOT
from trainyard.app.launcher import Service
from trainyard.app.states import JobState


def rate(seconds: list[float], samples: int) -> float:
    steady = seconds[1:] or seconds
    return samples * len(steady) / sum(steady)


def run_service(svc: Service, case: str | dict, epochs: int | None, device: str = "cpu") -> tuple[float, float]:
    """(samples/s, submit-to-succeeded seconds) of one job: a case of bench/cases.py, or a spec."""
    spec = {**json.loads(json.dumps(CASES[case] if isinstance(case, str) else case)), "device": device}
    if epochs:
        spec["train"]["epochs"] = epochs
    t0 = time.perf_counter()
    job = svc.wait_state(svc.submit(spec)["id"], timeout=1800)
    wall = time.perf_counter() - t0
    assert job["state"] == JobState.SUCCEEDED, job
    with svc.client() as c:
        history = c.get(f"/jobs/{job['id']}/metrics").json()
    # Every epoch trains on the same samples, so seconds per sample stand in for seconds per epoch.
    return rate([1.0 / m["samples_per_s"] for m in history], 1), wall


def run_loop(case: str, loop: str, epochs: int, data_dir: Path, device: str = "cpu") -> float:
    out = subprocess.run([sys.executable, "-m", "bench.loops", case, loop, str(epochs), str(data_dir), device],
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=1800)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return rate(res["seconds"], res["samples"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one round of short runs (a smoke test)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda:N: the worker's, and the loops'")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = ap.parse_args()
    cases = args.cases.split(",")
    if unknown := set(cases) - set(CASES):
        ap.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    rounds = 1 if args.quick else args.rounds
    tmp = Path(tempfile.mkdtemp(prefix="trainyard-bench-"))
    svc = Service.isolated(tmp / "data", env=PROD_ENV).start_server()
    svc.start_worker(args.device)
    results: dict[tuple[str, str], list[float]] = {}
    walls: dict[str, list[float]] = {}
    try:
        for r in range(rounds):
            for case in cases:
                epochs = 2 if args.quick else CASES[case]["train"]["epochs"]
                runners = [("service", None)] + [(loop, loop) for loop in YARDSTICKS[case]]
                if r % 2:  # alternate who goes first
                    runners.reverse()
                for name, loop in runners:
                    if loop is None:
                        value, wall = run_service(svc, case, epochs, args.device)
                        walls.setdefault(case, []).append(wall)
                    else:
                        value = run_loop(case, loop, epochs, svc.data_dir, args.device)
                    results.setdefault((case, name), []).append(value)
                    print(f"  round {r + 1} {case:14} {name:8} {value:10.0f} samples/s", file=sys.stderr)
    finally:
        svc.stop()
    print_table(results, walls, rounds, args.device, cases)


def print_table(results, walls, rounds, device: str = "cpu", cases=tuple(CASES)) -> None:
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{os.cpu_count()} cores, torch {torch.__version__}, device {device}, "
          f"{datetime.date.today()}, median of {rounds} alternating round(s)\n")
    print("| case | service samples/s | yardstick | yardstick samples/s | service / yardstick | service end-to-end s |")
    print("|---|---:|---|---:|---:|---:|")
    for case in cases:
        for loop in YARDSTICKS[case]:
            s, y = med[(case, "service")], med[(case, loop)]
            print(f"| {case} | {s:,.0f} | {loop} | {y:,.0f} | {s / y:.2f}x | {statistics.median(walls[case]):.2f} |")


if __name__ == "__main__":
    main()
