"""One job across two hosts against the same loop started by torchrun on the same two hosts.

`python -m bench.hosts [--rounds N] [--per-rank 32,128]` (as root: it makes network namespaces) makes two
hosts on a bridge of their own (app/cli/netns.py), forwards this machine's PostgreSQL to them, starts the
server here and one CPU worker in each host (TRAINYARD_NODE_ADDR: its address), and, N alternating rounds:
- service, 2 hosts: bench.ddp's job with `"devices": 2, "hosts": 2`, batch b per rank, one rank a host;
- torchrun, 2 hosts: bench.ddp's hand-written DDP loop, one `torchrun --nnodes 2 --nproc-per-node 1` in each
  host meeting at host A's address (static rendezvous), gloo over the hosts' link (GLOO_SOCKET_IFNAME).
Each host is given cores of its own (`taskset`: half of this machine's each), as separate machines would
have: the service's worker sizes its CPU jobs to them (worker/supervisor/prepare.py), the torchrun rank gets as many
torch threads. Throughput counts training steps only (samples of the global batch per second, first epoch
dropped), as bench.ddp does.
"""
import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import PROD_ENV, ROOT, alternating_rounds, postgres_schema
from bench.ddp import JOB, service_rate
from trainyard.app.cli import netns
from trainyard.app.launcher import Service, free_port


def cores_of(i: int) -> str:
    """Host i's cores (of two hosts): its half of this machine's."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    return ",".join(map(str, cores[i * half:(i + 1) * half] or cores[:half]))


def torchrun_rate(net: netns.Network, data: Path, per_rank: int, epochs: int, tries: int = 3) -> float:
    """The hand-written loop under torchrun on both hosts; a run whose rendezvous failed (its port taken since it
    was found free, say) is run again, saying why."""
    for left in range(tries - 1, -1, -1):
        try:
            return _torchrun_once(net, data, per_rank, epochs)
        except RuntimeError as exc:
            if not left:
                raise
            print(f"  torchrun again: {str(exc)[-500:]}", file=sys.stderr)
    raise AssertionError("unreachable")


def _torchrun_once(net: netns.Network, data: Path, per_rank: int, epochs: int) -> float:
    a = net.hosts[0]
    port = free_port()
    def argv(i: int, h: netns.Host) -> list[str]:
        return h.argv("taskset", "-c", cores_of(i), "env", "GLOO_SOCKET_IFNAME=eth0", f"PYTHONPATH={ROOT}",
                      sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                      "--node-rank", str(i), "--master-addr", a.addr, "--master-port", str(port),
                      "-m", "bench.ddp", "--torchrun", str(data / h.name), "--per-rank", str(per_rank),
                      "--threads", str(len(cores_of(i).split(","))), "--epochs", str(epochs))

    with tempfile.TemporaryFile("w+") as out0, tempfile.TemporaryFile("w+") as errs:
        procs = [subprocess.Popen(argv(i, h), cwd=ROOT, stdout=out0 if i == 0 else subprocess.DEVNULL, stderr=errs,
                                  text=True) for i, h in enumerate(net.hosts)]
        try:
            # One torchrun that fails leaves the other waiting at the rendezvous: stop it too.
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        if any(p.returncode for p in procs):
            errs.seek(0)
            raise RuntimeError(f"torchrun failed: {errs.read()[-3000:]}")
        out0.seek(0)
        return json.loads(out0.read().strip().splitlines()[-1])["rate"]


def main() -> None:
    # A SIGTERM unwinds like Ctrl-C, so that the hosts, the forwards and the schema are removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-rank", default="32,128", help="per-rank batch sizes, comma-separated")
    # At 32 images a rank an epoch takes 0.3 s here: 4 epochs (the first is not timed) timed about a second, a
    # window one hiccup of the machine fills.
    ap.add_argument("--epochs", type=int, default=12, help="epochs a run (the first is not timed)")
    args = ap.parse_args()
    why = netns.unavailable()
    if why:
        raise SystemExit(f"bench.hosts: {why}")
    sizes = [int(b) for b in args.per_rank.split(",")]
    threads = len(cores_of(0).split(","))
    tmp = Path(tempfile.mkdtemp(prefix="trainyard-bench-hosts-"))
    with netns.hosts(2) as net, postgres_schema("bhosts") as db_url:
        pg = net.forward(5432)
        svc = Service.isolated(tmp / "api", db_url, env={**PROD_ENV, "TRAINYARD_NODE_NAME": "api"}).start_server()
        try:
            for i, h in enumerate(net.hosts):
                svc.start_worker("cpu", wrap=h.argv("taskset", "-c", cores_of(i)), env={
                    "TRAINYARD_NODE_NAME": h.name, "TRAINYARD_DATABASE_URL": db_url.replace("127.0.0.1:5432", pg),
                    "TRAINYARD_DATA_DIR": str(tmp / h.name), "TRAINYARD_NODE_ADDR": h.addr})
            runners = {"service, 2 hosts": lambda b: service_rate(svc, 2, "cpu", b, hosts=2, epochs=args.epochs),
                       "torchrun, 2 hosts": lambda b: torchrun_rate(net, tmp / "torchrun", b, args.epochs)}
            service_rate(svc, 2, "cpu", sizes[0], hosts=2)  # each host decodes the dataset once, before any timing
            results = alternating_rounds(runners, sizes, args.rounds, width=20)
        finally:
            svc.stop()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{os.cpu_count()} cores, {threads} a host (taskset), torch {torch.__version__}, cpu, "
          f"{datetime.date.today()}, cifar_net on FakeData {JOB['data']['size']} images (80% train), {args.epochs} "
          f"epochs a run, median of "
          f"{args.rounds} alternating rounds\n")
    # Rounds on a shared machine are noisy: each round's ratio (its two runs back to back) and their median.
    print("| per-rank batch b | run | samples/s | service / this | rounds' ratios (median) |\n|---:|---|---:|---:|---|")
    for (b, name), value in med.items():
        ratios = [s / t for s, t in zip(results[(b, "service, 2 hosts")], results[(b, name)])]
        print(f"| {b} | {name} | {value:,.0f} | {med[(b, 'service, 2 hosts')] / value:.2f}x | "
              f"{', '.join(f'{r:.2f}' for r in ratios)} ({statistics.median(ratios):.2f}x) |")


if __name__ == "__main__":
    main()
