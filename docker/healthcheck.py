"""Container health check for both roles of the trainyard image; also the entrypoint's wait-for-API.

    healthcheck.py [auto|api|worker] [--url URL] [--wait SECONDS]

api     GET <url>/healthz answers 200 (url defaults to http://127.0.0.1:$TRAINYARD_PORT, port 8000).
        /healthz needs no token even when TRAINYARD_API_TOKEN is set, and it touches the database.
worker  every pid in the pid file the entrypoint wrote ($TRAINYARD_WORKER_PIDFILE) is alive and
        not a zombie. A worker serves no HTTP, and asking the API about it would make a worker
        "unhealthy" whenever the API restarts; the API reports lost workers itself (/workers).
auto    worker if that pid file exists (the entrypoint writes it for the worker roles only and
        removes it for the others), else api: this is what lets the image's one HEALTHCHECK
        serve both roles.

--wait  keep trying for up to SECONDS (the entrypoint uses it so a worker starts after the API has
        created the schema). Exit status 0 = healthy, 1 = not.
Standard library only: it runs every few seconds and must start fast.
"""
import argparse
import os
import sys
import time
import urllib.request
from pathlib import Path

PIDFILE = os.environ.get("TRAINYARD_WORKER_PIDFILE", "/tmp/trainyard-workers.pid")


def api_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=3) as r:
            return r.status == 200
    except Exception:  # refused, timeout, HTTP 5xx: all mean "not healthy"
        return False


def workers_ok(pidfile: Path) -> bool:
    try:
        pids = [int(p) for p in pidfile.read_text().split()]
    except (OSError, ValueError):
        return False
    for pid in pids:
        try:
            # Field 3 of /proc/PID/stat is the state; the name (field 2) may contain spaces.
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state in ("Z", "X"):  # dead, not yet reaped by its parent
            return False
    return bool(pids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="trainyard container health check")
    p.add_argument("role", nargs="?", choices=["auto", "api", "worker"], default="auto")
    p.add_argument("--url", default=f"http://127.0.0.1:{os.environ.get('TRAINYARD_PORT') or 8000}")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS")
    args = p.parse_args(argv)
    role = args.role
    if role == "auto":
        role = "worker" if Path(PIDFILE).exists() else "api"
    check = (lambda: workers_ok(Path(PIDFILE))) if role == "worker" else (lambda: api_ok(args.url))
    deadline = time.monotonic() + args.wait
    while True:
        if check():
            return 0
        if time.monotonic() >= deadline:
            target = PIDFILE if role == "worker" else args.url
            print(f"healthcheck: {role} at {target} is not healthy", file=sys.stderr)
            return 1
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
