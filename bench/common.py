"""Shared helpers for the benchmarks: a throwaway service, percentiles, CPU accounting, markdown tables."""
import datetime as dt
import importlib.metadata
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from trainyard.app.core.settings import Settings
from trainyard.app.launcher import Service, postgres_schema  # noqa: F401 - postgres_schema re-exported for the benchmarks

ROOT = Path(__file__).resolve().parents[1]  # the checkout the benchmarks run from

# The production defaults, not tests.helpers.service's FAST_ENV (short leases, 0.5 s heartbeats), so that
# background writes happen as often as they would in a real deployment. TRAINYARD_POLL_S is left
# at the code's default on purpose: it is what the dispatch benchmark measures.
PROD_ENV = {"TRAINYARD_LEASE_S": "15", "TRAINYARD_HEARTBEAT_S": "2", "TRAINYARD_GRACE_S": "30"}

TINY_JOB = {"kind": "train", "model": {"arch": "mlp", "hidden": [8]}, "data": {"dataset": "iris"},
            "train": {"epochs": 1, "batch_size": 32, "checkpoint_every": 0}, "device": "cpu"}


def env_line(backend: str = "SQLite") -> str:
    poll = Settings.model_fields["poll_s"].default
    rev = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return (f"{os.cpu_count()} CPU cores, no GPU · git {rev.stdout.strip() or '?'} · "
            f"Python {platform.python_version()} · torch {importlib.metadata.version('torch')} · "
            f"fastapi {importlib.metadata.version('fastapi')} · "
            f"uvicorn {importlib.metadata.version('uvicorn')} · {backend} · default poll_s {poll} s · "
            f"{dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z} · {load_note()}")


def load_note() -> str:
    """The machine's 1-minute load average: above ~2 on this 2-core box, other processes compete."""
    return f"1-min load average {os.getloadavg()[0]:.1f}"


@contextmanager
def service(workers: int = 0, device: str = "cpu", database_url: str = "", processes: int = 1,
            env: dict[str, str] | None = None) -> Iterator[Service]:
    """`trainyard serve` plus `workers` workers on a fresh temp data dir (and database_url, if given,
    and env's settings over PROD_ENV); all registered on entry."""
    tmp = Path(tempfile.mkdtemp(prefix="trainyard-bench-"))
    svc = Service.isolated(tmp / "data", database_url, env={**PROD_ENV, **(env or {})})
    try:
        svc.start_server(processes=processes)
        for _ in range(workers):  # start them side by side: each fork server imports torch
            svc.start_worker(device, wait=False)
        with svc.client() as c:
            svc.wait_until(lambda: sum(w["state"] == "idle" for w in c.get("/workers").json()) == workers,
                           180, f"{workers} idle workers")
        yield svc
    finally:
        svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def iso_s(text: str) -> float:
    """An ISO time from the API (database clock) as epoch seconds."""
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(values)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, math.ceil(len(s) * q / 100) - 1))]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process (all its threads) and its live children have used so far, from
    /proc (children count for `serve --workers N`, whose requests are served by child processes)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    kids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids |= {int(p) for p in (task / "children").read_text().split()}
    return own + sum(_cpu_or_zero(k) for k in kids)


def _cpu_or_zero(pid: int) -> float:
    try:
        return cpu_s(pid)
    except (FileNotFoundError, ProcessLookupError):  # it ended while we looked
        return 0.0


class CpuMeter:
    """CPU seconds used by some processes (and by this one, as "loadgen") over a window."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.start = {k: cpu_s(p) for k, p in pids.items()}
        self.self_start, self.t0 = time.process_time(), time.monotonic()

    def read(self) -> dict[str, float]:
        out = {k: cpu_s(p) - self.start[k] for k, p in self.pids.items()}
        return {**out, "loadgen": time.process_time() - self.self_start, "wall": time.monotonic() - self.t0}


def table(headers: list[str], rows: list[list]) -> str:
    def cell(v: object) -> str:
        return f"{v:.1f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def verdict(value: float, target: float, below: bool = True) -> str:
    ok = value < target if below else value >= target
    return "met" if ok else "**missed**"


def alternating_rounds(runners: Mapping[str, Callable[[int], float]], sizes: list[int], rounds: int,
                       width: int = 28) -> dict[tuple[int, str], list[float]]:
    """Each runner's figure for each size, `rounds` times, the runners' order reversed every other round so
    that a machine warming up or slowing down favours none; each figure printed to stderr as it comes."""
    results: dict[tuple[int, str], list[float]] = {}
    for r in range(rounds):
        for b in sizes:
            for name in (list(runners) if r % 2 == 0 else list(runners)[::-1]):
                results.setdefault((b, name), []).append(runners[name](b))
                print(f"  round {r + 1} b={b:<4} {name:{width}} {results[(b, name)][-1]:8.0f} samples/s",
                      file=sys.stderr)
    return results
