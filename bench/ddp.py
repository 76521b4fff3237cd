"""Multi-device training: a 2-rank job against the same job on one rank and a hand-written DDP loop.

`python -m bench.ddp [--rounds N] [--device cpu|cuda] [--per-rank 32,128]` starts the real service (server + two workers
on the device kind: `cpu` twice, or cuda:0 and cuda:1; SQLite) and, N alternating rounds:
- service, 2 ranks: the job with `"devices": 2`, batch_size b per rank (global batch 2b), for each b;
- service, 1 rank: the same job with batch_size 2b on one worker (the same steps);
- hand-written DDP: the torch.distributed loop people write by hand (two processes, gloo on the
  CPU or NCCL on CUDA, DistributedDataParallel, the data in memory, each rank slicing its half of
  every global batch from one shuffled index, the loss all-reduced once per epoch), with the optimizer the
  service builds (fused where PyTorch has the kernel), so that the ratio is what the service adds.
On the CPU every rank gets one torch thread, as the service's CPU workers do when two share two cores.

Throughput counts training steps only (samples of the whole global batch per second, evaluation and
checkpoints excluded, first epoch dropped as warm-up), from the job's own per-epoch metrics.
"""
import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import PROD_ENV, ROOT, alternating_rounds
from bench.train_throughput import rate
from trainyard.app.core.states import JobState
from trainyard.app.launcher import Service

JOB: dict[str, Any] = {"kind": "train", "name": "bench-ddp", "model": {"arch": "cifar_net"},
       "data": {"dataset": "fake", "image_size": [3, 32, 32], "num_classes": 10, "size": 4000},
       "train": {"epochs": 4, "optimizer": "sgd", "lr": 0.01, "momentum": 0.9}}


def service_rate(svc: Service, devices: int, kind: str, per_rank: int, hosts: int = 1, epochs: int = 0) -> float:
    train = {**JOB["train"], "batch_size": per_rank * (2 if devices == 1 else 1),
             "epochs": epochs or JOB["train"]["epochs"]}
    job = svc.wait_state(svc.submit({**JOB, "train": train, "devices": devices, "hosts": hosts, "device": kind})["id"],
                         timeout=1800, poll=1.0)
    assert job["state"] == JobState.SUCCEEDED, job
    assert (job["result"]["devices"]) == devices
    with svc.client() as c:
        history = c.get(f"/jobs/{job['id']}/metrics").json()
    return rate([1.0 / m["samples_per_s"] for m in history], 1)


# -- the hand-written loop ------------------------------------------------------------------------

def _rank(rank: int, world: int, init_method: str, data_dir: str, device_kind: str, per_rank: int, out,
          threads: int = 1, epochs: int = 0) -> None:
    import torch.distributed as dist
    from torch import nn

    from trainyard.app.spec import TrainJob, parse_spec
    from trainyard.worker import data, nets, train_setup

    spec = parse_spec({**JOB, "device": "cpu", "train": {**JOB["train"], "epochs": epochs or JOB["train"]["epochs"]}})
    assert isinstance(spec, TrainJob)
    device = torch.device(f"cuda:{rank}" if device_kind == "cuda" else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            rank=rank, world_size=world)
    d = data.load(spec.data, Path(data_dir), device)
    torch.manual_seed(0)
    model = nets.build_model(spec.model, d.input_shape, len(d.class_names)).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = train_setup.make_optimizer(spec.train, model)  # the service's own choice
    criterion = nn.CrossEntropyLoss()
    x, y, n, g = d.x_train, d.y_train, len(d.y_train), per_rank * world
    shuffle = torch.Generator().manual_seed(0)
    seconds = []
    for _ in range(spec.train.epochs):
        dist.barrier()
        t0 = time.perf_counter()
        perm = torch.randperm(n, generator=shuffle).to(x.device)
        total = torch.zeros((), device=device)
        for start in range(0, n, g):
            idx = perm[start:start + g].tensor_split(world)[rank]
            loss = criterion(model(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(idx)
        dist.all_reduce(total)
        total.item()
        seconds.append(time.perf_counter() - t0)
    if rank == 0:
        out.put({"seconds": seconds, "samples": n})
    dist.destroy_process_group()


def hand_written(data_dir: Path, device_kind: str, per_rank: int, world: int = 2) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = tempfile.mktemp(prefix="trainyard-bench-ddp-")
    procs = [ctx.Process(target=_rank, args=(r, world, f"file://{store}", str(data_dir), device_kind, per_rank, out))
             for r in range(world)]
    for p in procs:
        p.start()
    res = out.get(timeout=1800)
    for p in procs:
        p.join(60)
    return rate(res["seconds"], res["samples"])


class _Printed:
    """The loop's result as torchrun's rank 0 reports it: one JSON line on stdout."""
    def put(self, res: dict) -> None:
        print(json.dumps({"rate": rate(res["seconds"], res["samples"])}), flush=True)


def torchrun_rank(data_dir: str, per_rank: int, threads: int, epochs: int = 0) -> None:
    """One rank of the hand-written loop as torchrun starts it (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    _rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", data_dir, "cpu", per_rank, _Printed(),
          threads, epochs)
    # No interpreter teardown, as a job process ends (worker/runner.py): gloo's destructors racing the other
    # host's exit sometimes abort a rank that had finished.
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--per-rank", default="32,128", help="per-rank batch sizes, comma-separated")
    ap.add_argument("--hand-written", dest="hand", help=argparse.SUPPRESS)  # internal: one run of the loop
    ap.add_argument("--torchrun", help=argparse.SUPPRESS)  # internal: a rank under torchrun (bench/hosts.py)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--epochs", type=int, default=0, help=argparse.SUPPRESS)  # with --torchrun: instead of JOB's
    args = ap.parse_args()
    sizes = [int(b) for b in args.per_rank.split(",")]
    if args.torchrun:
        torchrun_rank(args.torchrun, sizes[0], args.threads, args.epochs)
        return
    if args.hand:
        print(json.dumps({"rate": hand_written(Path(args.hand), args.device, sizes[0])}))
        return
    tmp = Path(tempfile.mkdtemp(prefix="trainyard-bench-"))
    svc = Service.isolated(tmp / "data", env=PROD_ENV).start_server()
    for d in (["cpu", "cpu"] if args.device == "cpu" else ["cuda:0", "cuda:1"]):
        svc.start_worker(d)

    def hand(b: int) -> float:
        out = subprocess.run([sys.executable, "-m", "bench.ddp", "--device", args.device, "--per-rank", str(b),
                              "--hand-written", str(svc.data_dir)],
                             cwd=ROOT, capture_output=True, text=True, check=True, timeout=1800)
        return json.loads(out.stdout.strip().splitlines()[-1])["rate"]

    runners = {"service, 2 ranks": lambda b: service_rate(svc, 2, args.device, b),
               "service, 1 rank (batch 2b)": lambda b: service_rate(svc, 1, args.device, b),
               "hand-written DDP, 2 ranks": hand}
    try:
        service_rate(svc, 1, args.device, sizes[0])  # the dataset decoded into the cache once, before any timing
        results = alternating_rounds(runners, sizes, args.rounds)
    finally:
        svc.stop()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{os.cpu_count()} cores, torch {torch.__version__}, {args.device}, {datetime.date.today()}, cifar_net on "
          f"FakeData {JOB['data']['size']} images (80% train), median of {args.rounds} alternating rounds\n")
    print("| per-rank batch b | run | samples/s | service 2 ranks / this |\n|---:|---|---:|---:|")
    for (b, name), value in med.items():
        print(f"| {b} | {name} | {value:,.0f} | {med[(b, 'service, 2 ranks')] / value:.2f}x |")


if __name__ == "__main__":
    main()
