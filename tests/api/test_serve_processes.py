"""`trainyard serve --workers N`: several server processes share the port, and only one of them runs
the lease reaper at a time (the one holding the data directory's housekeeping lock, read here from
/proc/locks); when it dies another takes over, and a lost job is still requeued."""
import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.jobs import slow_job
from tests.helpers.service import Service

pytestmark = pytest.mark.slow


def lock_holders(path: Path) -> set[int]:
    inode = os.stat(path).st_ino
    holders = set()
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if len(parts) > 5 and parts[1] == "FLOCK" and int(parts[5].rsplit(":", 1)[1]) == inode:
            holders.add(int(parts[4]))
    return holders


def children(pid: int) -> set[int]:
    """uvicorn's server processes under its supervisor (not multiprocessing's resource tracker)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(p) for p in (task / "children").read_text().split()}
    return {p for p in found if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()}


def test_several_server_processes_sweep_for_lost_jobs_once(tmp_path):
    svc = Service(tmp_path / "data").start_server(processes=3)
    try:
        lock = svc.data_dir / "housekeeping.lock"
        svc.wait_until(lambda: len(children(svc.server.pid)) == 3, 60, "three server processes")
        svc.wait_until(lambda: lock.exists() and len(lock_holders(lock)) == 1, 30, "one process to hold the lock")
        [first] = lock_holders(lock)
        assert first in children(svc.server.pid)
        time.sleep(3)  # several sweep periods: still one holder
        assert lock_holders(lock) == {first}

        os.kill(first, signal.SIGKILL)  # the sweeping process dies; uvicorn starts a new one
        svc.wait_until(lambda: lock_holders(lock) - {first}, 30, "another process to take the lock over")
        assert len(lock_holders(lock)) == 1

        worker = svc.start_worker("cpu")
        job = svc.submit(slow_job(epochs=30))
        svc.wait_until(lambda: svc.job(job["id"])["state"] == "running", 60, "the job to start")
        os.kill(worker.pid, signal.SIGKILL)  # no worker is left: only the server can requeue it
        back = svc.wait_state(job["id"], states=("queued",), timeout=30)
        assert back["errors"][-1]["type"] == "LeaseExpired"
        with svc.client() as c:
            for _ in range(30):  # every process answers (connections spread over them)
                assert c.get("/healthz").status_code == 200
    finally:
        svc.stop()
