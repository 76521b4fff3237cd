"""Container health check for both roles of the trainyard image; also the entrypoint's wait-for-API.

    healthcheck.py [auto|api|worker] [--url URL] [--wait SECONDS] [--liveness]

api     GET <url>/healthz answers 200 (url defaults to http://127.0.0.1:$TRAINYARD_PORT, port 8000).
        /healthz needs no token even when TRAINYARD_API_TOKEN is set, and it touches the database.
worker  every pid in the pid file the entrypoint wrote ($TRAINYARD_WORKER_PIDFILE) is alive and not a
        zombie, and its worker's status file, <pid>.json in $TRAINYARD_WORKER_STATUS_DIR (which the
        entrypoint gives the workers, default /tmp/trainyard-workers.status), was written within the
        bound the worker states in it (it rewrites it at every heartbeat: an older one is a hung
        worker) and does not say `unavailable` (the worker cannot use its device: no usable CUDA, a
        failed GPU). A worker serves no HTTP, and asking the API about it would make a worker
        "unhealthy" whenever the API restarts: the file is worker/supervisor/status_file.py's.
auto    worker if that pid file exists (the entrypoint writes it for the worker roles only and
        removes it for the others), else api: this is what lets the image's one HEALTHCHECK
        serve both roles.

--liveness  for a worker: alive and not hung, `unavailable` or not (Kubernetes' liveness probe: a restart
        would forget that a device failed under a job and hand it the next one; the readiness probe, without
        the flag, takes such a pod out of service and kubectl shows it not ready, with why in /workers).
--wait  keep trying for up to SECONDS (the entrypoint uses it so a worker starts after the API has
        created the schema). Exit status 0 = healthy, 1 = not, saying which worker and why.
Standard library only: it runs every few seconds and must start fast.
"""
import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

PIDFILE = os.environ.get("TRAINYARD_WORKER_PIDFILE", "/tmp/trainyard-workers.pid")
STATUS_DIR = os.environ.get("TRAINYARD_WORKER_STATUS_DIR") or "/tmp/trainyard-workers.status"


def api_problem(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=3) as r:
            return None if r.status == 200 else f"the API at {url} answered {r.status}"
    except Exception as exc:  # refused, timeout, HTTP 5xx: all mean "not healthy"
        return f"the API at {url} is not healthy: {exc}"


def workers_problem(pidfile: Path, status_dir: Path, now: float | None = None, liveness: bool = False) -> str | None:
    """Why the workers the pid file names are not healthy (the first found), or None when they are; liveness:
    an unavailable worker passes (it is alive, and says why it takes no job)."""
    try:
        pids = [int(p) for p in pidfile.read_text().split()]
    except (OSError, ValueError) as exc:
        return f"no worker pids in {pidfile}: {exc}"
    if not pids:
        return f"no worker pids in {pidfile}"
    for pid in pids:
        problem = process_problem(pid) or status_problem(pid, status_dir, time.time() if now is None else now,
                                                         liveness)
        if problem:
            return f"worker pid {pid} {problem}"
    return None


def process_problem(pid: int) -> str | None:
    try:
        # Field 3 of /proc/PID/stat is the state; the name (field 2) may contain spaces.
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "is not running"
    if state in ("Z", "X"):  # dead, not yet reaped by its parent
        return "has exited"
    return None


def status_problem(pid: int, status_dir: Path, now: float, liveness: bool = False) -> str | None:
    """What the worker's own status file (worker/supervisor/status_file.py) says is wrong with it."""
    path = status_dir / f"{pid}.json"
    try:
        status = json.loads(path.read_text())
        at, bound = float(status["at"]), float(status["stale_after_s"])
    except FileNotFoundError:
        return f"has written no status ({path}): still starting, or not a trainyard worker"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"has an unreadable status file {path}: {exc!r}"
    if status.get("pid") != pid:
        return f"has a status file {path} written by pid {status.get('pid')}"
    if not liveness and (status.get("state") == "unavailable" or status.get("unavailable")):
        return f"is unavailable, it takes no job: {status.get('unavailable') or 'no reason given'}"
    age = now - at
    if not -bound <= age <= bound:  # far in the future too: a clock set back, or a file of another boot
        return (f"is hung: its last heartbeat ({status.get('state')}) was {age:.0f} s ago, past its bound of "
                f"{bound:g} s")
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="trainyard container health check")
    p.add_argument("role", nargs="?", choices=["auto", "api", "worker"], default="auto")
    p.add_argument("--url", default=f"http://127.0.0.1:{os.environ.get('TRAINYARD_PORT') or 8000}")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS")
    p.add_argument("--liveness", action="store_true", help="a worker: alive and not hung, unavailable or not")
    args = p.parse_args(argv)
    role = args.role
    if role == "auto":
        role = "worker" if Path(PIDFILE).exists() else "api"
    check = (lambda: workers_problem(Path(PIDFILE), Path(STATUS_DIR), liveness=args.liveness)) if role == "worker" \
        else (lambda: api_problem(args.url))
    deadline = time.monotonic() + args.wait
    while True:
        problem = check()
        if problem is None:
            return 0
        if time.monotonic() >= deadline:
            target = PIDFILE if role == "worker" else args.url
            print(f"healthcheck: {role} at {target} is not healthy: {problem}", file=sys.stderr)
            return 1
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
