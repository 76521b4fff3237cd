"""One Iris epoch in one process: the service's train_epoch against seed 000's epoch body, side by side.

`python -m bench.epoch_overhead [--rounds N]` builds the Iris case of bench/cases.py as the service does
(worker/train_setup.build) and seed 000's loop beside it (bench/loops.py), then times blocks of 50 epochs
of each, interleaved and alternating in order, by this thread's CPU time (another process on the core
does not count), and prints the medians and their ratio. Seed 000's epoch body runs here with the
service's optimizer (train_setup.make_optimizer: fused), not the tutorial's per-tensor Adam, and there is
no server, supervisor or fork server: what is left between the two is the training loop's own bookkeeping.
The second table times each piece of that bookkeeping inside the service's epoch, where a step has just
left the caches cold.
"""
import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from bench.cases import CASES
from trainyard.app.spec import TrainJob, parse_spec
from trainyard.worker import nets, train, train_setup
from trainyard.worker.job_context import JobContext
from trainyard.worker.train_checkpoint import resume

BLOCK = 50  # epochs of one runner in a row


def context(root: Path) -> JobContext:
    return JobContext(job_id=1, device=torch.device("cpu"), data_dir=root / "data", artifact_dir=root / "artifact",
                      checkpoint_path=root / "checkpoint.pt")


def runners(spec: TrainJob, ctx: JobContext) -> dict[str, Callable[[], None]]:
    run = train.build(spec, ctx)
    at = resume(run, ctx)
    torch.manual_seed(spec.train.seed)
    d = run.data
    model = nets.build_model(spec.model, d.input_shape, len(d.class_names))
    criterion, optimizer = nn.CrossEntropyLoss(), train_setup.make_optimizer(spec.train, model)  # the service's
    losses: list[torch.Tensor] = []
    epoch = [0]

    def seed000() -> None:  # bench/loops.py's seed000, one epoch (with the service's optimizer)
        loss = criterion(model.forward(d.x_train), d.y_train)
        losses.append(loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if len(losses) > 1000:
            losses.clear()

    def service() -> None:
        train.train_epoch(run, ctx, epoch[0] % spec.train.epochs, at)
        epoch[0] += 1

    return {"seed000": seed000, "train_epoch": service}


def pieces(spec: TrainJob, ctx: JobContext, epochs: int) -> dict[str, float]:
    """Median µs of each piece of train_epoch's bookkeeping, timed in place around a real step."""
    run = train.build(spec, ctx)
    resume(run, ctx)
    clock = time.perf_counter_ns
    seen: dict[str, list[int]] = {}
    for e in range(epochs):
        t = [clock()]
        run.shuffle.get_state()
        t.append(clock())
        loss_sum = torch.zeros((), device=run.device)
        t.append(clock())
        run.train_mode()
        t.append(clock())
        run.stop_vote(ctx.stop_requested())
        xb, yb, count, _ = train.batch(run, None, run.global_batch, e, 0)
        t.append(clock())
        loss = train.step_on(run, xb, yb)
        t.append(clock())
        loss_sum.add_(loss, alpha=count)
        t.append(clock())
        math.isfinite(loss_sum.item() / count)
        t.append(clock())
        names = ("generator state", "loss sum tensor", "train-mode check", "stop vote and batch", "the step",
                 "add to the sum", ".item()")
        for name, a, b in zip(names, t, t[1:]):
            seen.setdefault(name, []).append(b - a)
    return {name: statistics.median(v[epochs // 5:]) / 1e3 for name, v in seen.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40, help="blocks of 50 epochs of each runner")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the loops' best count on the CPU (bench/train_throughput.py)
    spec = parse_spec(CASES["iris-mlp"])
    assert isinstance(spec, TrainJob)
    ctx = context(Path(tempfile.mkdtemp(prefix="trainyard-bench-")))
    timed = runners(spec, ctx)
    times: dict[str, list[int]] = {name: [] for name in timed}
    for r in range(args.rounds):
        for name in (list(timed) if r % 2 else list(timed)[::-1]):
            for _ in range(BLOCK):
                t = time.thread_time_ns()
                timed[name]()
                times[name].append(time.thread_time_ns() - t)
    med = {name: statistics.median(v) / 1e3 for name, v in times.items()}
    print(f"\ntorch {torch.__version__}, 1 thread, {args.rounds} x {BLOCK} epochs each, median µs of thread CPU time\n")
    print("| seed000 epoch µs | train_epoch µs | seed000 / train_epoch |\n|---:|---:|---:|")
    print(f"| {med['seed000']:.1f} | {med['train_epoch']:.1f} | {med['seed000'] / med['train_epoch']:.3f}x |\n")
    print("| piece of train_epoch | median µs |\n|---|---:|")
    for name, us in pieces(spec, ctx, args.rounds * BLOCK).items():
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
