"""What image augmentation (train.augment, worker/augment.py) costs cifar_net: in-process, and through the service.

`python -m bench.augment [--rounds N] [--quick] [--device cuda:0]` prints two tables:
- in-process: the augmentation alone on a 64 x 3 x 32 x 32 batch beside one cifar_net training step on
  such a batch (gathered from data in memory, forward, backward, SGD), and a step on an augmented batch;
  the throughput ratio is step / augmented step. Each time is the median of short blocks, all kinds
  interleaved, so that load from other processes falls on each alike.
- service: the real service (server + one worker on the device; SQLite) runs the cifar_net-b64 case of
  bench/cases.py with and without train.augment, alternating, N rounds; samples/s comes from the jobs'
  own per-epoch metrics, as in bench/train_throughput.py (whose functions this reuses).
The target (issue 13): with augmentation, cifar_net keeps >= 0.9x of its throughput without.
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.cases import CASES
from bench.common import PROD_ENV, load_note, table, verdict
from bench.train_throughput import run_service
from trainyard.app.launcher import Service
from trainyard.app.spec import Augment, ModelSpec, TrainParams
from trainyard.worker import nets, train_setup
from trainyard.worker.augment import BatchAugment

TARGET = 0.9
BASE = "cifar_net-b64"
AUGMENT: dict[str, Any] = {"crop_padding": 4, "horizontal_flip": True}
# The augmented twin of the base case.
CASES_WITH_AUGMENT = {f"{BASE}+augment": {**CASES[BASE], "train": {**CASES[BASE]["train"], "augment": AUGMENT}}}


def timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def seconds(fn: Callable[[], object], n: int) -> float:
        """Seconds per call of fn over a block of n calls; the device's queue drained on both sides."""
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t0) / n
    return seconds


def in_process(device: torch.device, blocks: int, calls: int) -> list[list]:
    """Rows of (what, µs per batch, / plain step, throughput ratio, verdict), for each memory format."""
    rows = []
    for channels_last in (False, True):
        med = time_layout(device, channels_last, blocks, calls)
        layout = "channels_last" if channels_last else "contiguous"
        ratio = med["step"] / med["augmented step"]  # throughput with / without
        rows.append([f"cifar_net step ({layout})", f"{med['step'] * 1e6:,.0f}", "1.000", "", ""])
        augmented = med["augmented step"]
        rows.append([f"step on an augmented batch ({layout})", f"{augmented * 1e6:,.0f}",
                     f"{augmented / med['step']:.3f}", f"{ratio:.3f}x", verdict(ratio, TARGET, below=False)])
        rows += [[f"{name} alone ({layout})", f"{med[name] * 1e6:,.0f}", f"{med[name] / med['step']:.3f}", "", ""]
                 for name in med if name not in ("step", "augmented step")]
    return rows


def time_layout(device: torch.device, channels_last: bool, blocks: int, calls: int) -> dict[str, float]:
    """Median seconds per call of a plain step, a step on an augmented batch, and each augmentation alone."""
    torch.manual_seed(0)
    model = nets.build_model(ModelSpec(arch="cifar_net", params=None), (3, 32, 32), 10).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = train_setup.make_optimizer(TrainParams(optimizer="sgd", lr=0.001), model)
    criterion = nn.CrossEntropyLoss()
    x_train, y_train = torch.randn(2048, 3, 32, 32, device=device), torch.randint(0, 10, (2048,), device=device)
    augments = {"crop + flip": BatchAugment(Augment(**AUGMENT), seed=0),
                "crop only": BatchAugment(Augment(crop_padding=4, horizontal_flip=False), seed=0),
                "flip only": BatchAugment(Augment(crop_padding=0), seed=0)}
    steps = iter(range(10**9))  # a new step per call: fresh draws and another batch, as in training

    def batch() -> tuple[torch.Tensor, torch.Tensor, int]:
        # As worker/train.py makes one: a fresh tensor gathered from the data in memory (a step on
        # one tensor reused would flatter the baseline: it never allocates its input).
        step = next(steps)
        idx = torch.randint(0, len(y_train), (64,), generator=torch.Generator().manual_seed(step)).to(device)
        xb = x_train[idx]
        return (xb.contiguous(memory_format=torch.channels_last) if channels_last else xb), y_train[idx], step

    def train_step(augment: BatchAugment | None) -> None:
        xb, yb, step = batch()
        loss = criterion(model(augment(xb, 0, step) if augment else xb), yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    x = batch()[0]
    def alone(a: BatchAugment) -> Callable[[], object]:
        return lambda: a(x, 0, next(steps))

    runs: dict[str, Callable[[], object]] = {"step": lambda: train_step(None),
                                             "augmented step": lambda: train_step(augments["crop + flip"])}
    runs |= {name: alone(a) for name, a in augments.items()}
    seconds = timer(device)
    for fn in runs.values():  # warm-up: first calls allocate, cuDNN picks algorithms
        seconds(fn, 3)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for block in range(blocks):
        for name, fn in (runs.items() if block % 2 else reversed(runs.items())):
            times[name].append(seconds(fn, calls))
    return {name: statistics.median(t) for name, t in times.items()}


def through_service(device: str, rounds: int, epochs: int | None) -> list[list]:
    """Rows of (case, samples/s without, with, ratio, verdict): medians of alternating rounds."""
    names = [BASE, *CASES_WITH_AUGMENT]
    rates: dict[str, list[float]] = {name: [] for name in names}
    tmp = Path(tempfile.mkdtemp(prefix="trainyard-bench-"))
    svc = Service.isolated(tmp / "data", env=PROD_ENV).start_server()
    try:
        svc.start_worker(device)
        specs = {BASE: CASES[BASE], **CASES_WITH_AUGMENT}
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:  # alternate who goes first
                rates[name].append(run_service(svc, specs[name], epochs, device)[0])
                print(f"  round {r + 1} {name:24} {rates[name][-1]:10,.0f} samples/s", file=sys.stderr)
    finally:
        svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    plain, augmented = (statistics.median(rates[name]) for name in names)
    ratio = augmented / plain
    return [[BASE, f"{plain:,.0f}", f"{augmented:,.0f}", f"{ratio:.3f}x", verdict(ratio, TARGET, below=False)]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating service rounds")
    ap.add_argument("--quick", action="store_true", help="short blocks, one round of 2-epoch jobs (a smoke test)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda:N: the in-process runs', and the worker's")
    ap.add_argument("--no-service", action="store_true", help="the in-process table only")
    ap.add_argument("--threads", type=int, help="in-process CPU threads (default torch's, all cores, as a lone "
                    "worker's job gets); 1 is steadier on a machine busy with other work")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"\n{os.cpu_count()} cores ({torch.get_num_threads()} in-process threads), torch {torch.__version__}, "
          f"device {args.device}, {datetime.date.today()}, "
          f"{load_note()}; augment {json.dumps(AUGMENT)}; target >= {TARGET}x\n")
    rows = in_process(device, blocks=5 if args.quick else 30, calls=5 if args.quick else 20)
    print("In-process, batch 64 x 3 x 32 x 32 (median of interleaved blocks):\n")
    print(table(["what", "µs per batch", "/ plain step", "throughput ratio", f">= {TARGET}x"], rows))
    if args.no_service:
        return
    rounds = 1 if args.quick else args.rounds
    rows = through_service(args.device, rounds, 2 if args.quick else None)
    print(f"\nService, samples/s from the jobs' per-epoch metrics (median of {rounds} alternating round(s)):\n")
    print(table(["case", "samples/s without", "samples/s with augment", "with / without", f">= {TARGET}x"], rows))


if __name__ == "__main__":
    main()
