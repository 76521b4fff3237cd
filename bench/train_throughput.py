"""Training throughput: the service against hand-written PyTorch loops, same model, data and spec.

`python -m bench.train_throughput [--rounds N] [--quick] [--device cuda:0] [--cases iris-mlp,image,...]
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

The image cases (`--cases image`: ResNet-18 at 32x32, batch 256, bf16 autocast, channels_last, with and without
torch.compile) are what a GPU user trains; on the CPU they run at a smoke-test size (bench/cases.py spec_for),
and the compiled one only when named (inductor takes minutes on a few cores). Each row also gives both sides'
model FLOPs utilisation (bench/flops.py: training FLOPs per sample x samples/s over the card's dense peak for
the precision applied; "n/a" on the CPU or a card without a known peak).
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import flops
from bench.cases import CASES, GROUPS, TARGETS, YARDSTICKS, expand, spec_for
from bench.common import ROOT, iso_s, load_note, service
from bench.loops import model_switches, numerics
from trainyard.app.core.states import TERMINAL, JobState
from trainyard.app.launcher import Service

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
    spec = spec_for(case, device) if isinstance(case, str) else {**json.loads(json.dumps(case)), "device": device}
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
    NUMERICS_SEEN[(case if isinstance(case, str) else spec.get("name", "spec"), SERVICE)] = \
        f"{numerics(applied)}; {model_switches(applied)}"
    # Every epoch trains on the same samples, so seconds per sample stand in for seconds per epoch.
    return rate([1.0 / m["samples_per_s"] for m in history], 1), wall, applied.get("cpu_threads")


def run_loop(case: str, loop: str, epochs: int, data_dir: Path, device: str = "cpu",
             threads: int | None = None) -> float:
    args = [case, loop, str(epochs), str(data_dir), device] + ([str(threads)] if threads else [])
    out = subprocess.run([sys.executable, "-m", "bench.loops", *args],
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=1800)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    NUMERICS_SEEN[(case, loop)] = f"{res['numerics']}; {res['model_switches']}"
    PEAK_SEEN[case] = (res["flops_per_sample"], flops.peak_flops(res["device_name"], res["precision"], res["tf32"]),
                       res["device_name"])
    return rate(res["seconds"], res["samples"])


# Each (case, runner)'s numerics and model switches (bench/loops.py numerics(), model_switches()), as last seen:
# printed beside the table, side by side.
NUMERICS_SEEN: dict[tuple[str, str], str] = {}
# Each case's training FLOPs per sample, its card's peak FLOP/s (None: unknown, the CPU) and the card's name, as
# the loops report them: the same model and numerics on both sides, so the service's MFU takes them too.
PEAK_SEEN: dict[str, tuple[int, float | None, str]] = {}


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
    groups = "; ".join(f"{group}: {' and '.join(cases)}" for group, cases in GROUPS.items())
    ap.add_argument("--cases", help=f"comma-separated, of {', '.join(CASES)}, or a group ({groups}); "
                    "default: all (on the CPU all but the compiled ones)")
    ap.add_argument("--threads", help="comma-separated torch thread counts to try the loops at "
                    "(default on the CPU: 1 up to the cores)")
    ap.add_argument("--loops", help="comma-separated: only these of each case's yardsticks (default: all)")
    args = ap.parse_args()
    names = expand(args.cases) if args.cases else default_cases(args.device)
    if unknown := set(names) - set(CASES):
        ap.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    only = set(args.loops.split(",")) if args.loops else None
    cases = {case: [loop for loop in YARDSTICKS[case] if only is None or loop in only] for case in names}
    rounds = 1 if args.quick else args.rounds
    counts = thread_counts(args.device, args.threads)
    with service(workers=1, device=args.device) as svc:  # its data dir goes with it: 86 MB a run
        results, walls, service_threads = measure(svc, cases, rounds, args.quick, args.device, counts)
    print(f"\n{os.cpu_count()} cores, torch {torch.__version__}, device {args.device}, {datetime.date.today()}, "
          f"median of {rounds} interleaved round(s), loops at their best of threads {counts}, {load_note()}\n")
    print_table(results, walls, service_threads, cases)
    print("\nMFU: training FLOPs per sample (3x the forward's, bench/flops.py) x samples/s / the card's dense peak:")
    for case, (per_sample, peak, name) in PEAK_SEEN.items():
        at = f"{peak / 1e12:,.1f} TFLOP/s" if peak else "n/a (no known peak)"
        print(f"- {case}: {per_sample / 1e6:,.1f} MFLOP a sample; {name}: {at}")
    print(f"\nNumerics on {args.device}, each side as it ran (the loops apply the service's switches for the spec):")
    for (case, runner), seen in sorted(NUMERICS_SEEN.items()):
        print(f"- {case} {runner}: {seen}")


def default_cases(device: str) -> list[str]:
    """Every case; on the CPU not the compiled ones (inductor takes minutes there: name them to run them)."""
    return [case for case, spec in CASES.items() if device != "cpu" or not spec["train"].get("compile")]


def print_table(results: dict, walls: dict, service_threads: dict, cases: dict[str, list[str]]) -> None:
    """One row per (case, yardstick): the yardstick at its best thread count; the columns bench/gpu_check
    reads (case, yardstick, ratio) stay at 0, 2 and 4; the MFU columns come last."""
    med = {k: statistics.median(v) for k, v in results.items()}
    print("| case | service samples/s | yardstick | yardstick samples/s | service / yardstick | target "
          "| rounds' ratios | yardstick threads | service threads | service end-to-end s | service MFU "
          "| yardstick MFU |")
    print("|---|---:|---|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for case, loops in cases.items():
        s = med[(case, (SERVICE, None))]
        for loop in loops:
            tried = {n: v for (c, (name, n)), v in med.items() if c == case and name == loop}
            best = max(tried, key=lambda n: tried[n])
            y, target = tried[best], TARGETS.get((case, loop))
            verdict = "-" if target is None else f">= {target:.2f}x: {'met' if s / y >= target else 'NOT met'}"
            # Round by round, the service against the loop at that best count: how much the ratio moves.
            each = [a / b for a, b in zip(results[(case, (SERVICE, None))], results[(case, (loop, best))])]
            per_sample, peak, _ = PEAK_SEEN.get(case, (0, None, ""))
            print(f"| {case} | {shown_rate(s)} | {loop} | {shown_rate(y)} | {s / y:.3f}x | {verdict} | "
                  f"{min(each):.2f}-{max(each):.2f} | {best or 'default'} | "
                  f"{service_threads.get(case) or '-'} | {statistics.median(walls[case]):.2f} | "
                  f"{flops.shown(flops.mfu(s, per_sample, peak))} | {flops.shown(flops.mfu(y, per_sample, peak))} |")


def shown_rate(samples_per_s: float) -> str:
    """Thousands separated; three digits below 100 (a ResNet-18 on the CPU trains a few samples a second)."""
    return f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.3g}"


if __name__ == "__main__":
    main()
