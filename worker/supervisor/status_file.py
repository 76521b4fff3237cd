"""A worker's state for the container's health check (docker/healthcheck.py reads it): one small JSON file
per worker process, `<TRAINYARD_WORKER_STATUS_DIR>/<pid>.json`, rewritten at each heartbeat.

    {"pid": 123, "state": "idle" | "busy" | "stopping" | "unavailable", "unavailable": why | null,
     "at": wall-clock seconds, "stale_after_s": seconds}

A local file because a worker serves no HTTP, and asking the API about it would make every worker
unhealthy while the API restarts. The health check calls a worker hung once its file is older than
stale_after_s, which the worker states itself (the check does not read the settings): two leases, past
which the API has long listed it as lost, plus a heartbeat, so that a database outage (a heartbeat
retried for a lease, then a pause) does not read as a hang. Torch-free and cheap: one write of about
150 bytes per heartbeat, made whole by os.replace, so the check never reads half a file.
"""
import json
import logging
import os
import time

from trainyard.app.core.settings import Settings

log = logging.getLogger("trainyard.worker")
_failed: set[str] = set()  # directories a write already failed in: said once, not at every heartbeat


def stale_after_s(settings: Settings) -> float:
    return 2 * settings.lease_s + settings.heartbeat_s


def write(settings: Settings, state: str, unavailable: str | None) -> None:
    """This worker's state now, for the health check; nothing when TRAINYARD_WORKER_STATUS_DIR is unset. A
    directory that cannot be written is logged, never raised: the health check then says the file is stale."""
    directory = settings.worker_status_dir
    if directory is None:
        return
    pid = os.getpid()
    body = json.dumps({"pid": pid, "state": state, "unavailable": unavailable, "at": time.time(),
                       "stale_after_s": stale_after_s(settings)})
    path, tmp = directory / f"{pid}.json", directory / f".{pid}.json.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp.write_text(body)
        os.replace(tmp, path)
    except OSError as exc:
        if str(directory) not in _failed:
            _failed.add(str(directory))
            log.error("cannot write this worker's status for the health check in %s: %s", directory, exc)
