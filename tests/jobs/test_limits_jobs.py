"""What one job may cost the host: a job process over its memory budget, or killed by the kernel,
fails `oom` with what it used and is not retried; one that crashes fails `crashed`. Real processes,
real memory, real signals."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.service import Service
from trainyard.worker.supervisor import memory

pytestmark = pytest.mark.slow
GiB = 1 << 30


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    """A CPU worker whose jobs may use 1.5 GiB each; models past the default parameter limit allowed."""
    svc = Service(tmp_path_factory.mktemp("budget") / "data",
                  env={"TRAINYARD_JOB_MEMORY_BYTES": str(int(1.5 * GiB)), "TRAINYARD_MAX_PARAMETERS": str(10**10)})
    svc.start_server()
    svc.start_worker("cpu")
    yield svc
    svc.stop()


def logs(svc, job_id) -> str:
    with svc.client() as c:
        return c.get(f"/jobs/{job_id}/logs").text


def test_a_job_over_its_budget_fails_oom_once_and_the_worker_goes_on(tight):
    # 268M parameters: 1 GiB of weights, as much again of gradients, twice that of Adam state.
    job = tight.submit({**tiny_job(), "model": {"arch": "mlp", "hidden": [16384, 16384]}, "max_attempts": 5})
    t0 = time.monotonic()
    done = tight.wait_state(job["id"], timeout=120)
    assert done["state"] == "failed" and done["error"]["class"] == "oom", done
    assert done["attempt"] == 1 and len(done["errors"]) == 1  # not retried, though 5 attempts were allowed
    assert "budget is 1.50 GiB" in done["error"]["message"] and "can't allocate memory" in done["error"]["message"]
    peak = float(re.search(r"peak memory: ([\d.]+) GiB", logs(tight, job["id"])).group(1))
    assert peak <= 1.5 + 0.1, peak
    assert time.monotonic() - t0 < 60
    nxt = tight.wait_state(tight.submit(tiny_job())["id"])
    assert nxt["state"] == "succeeded" and all(p.poll() is None for p in tight.workers)


def job_pid(svc, job_id) -> int:
    svc.wait_until(lambda: svc.job(job_id)["progress"]["epoch"] >= 1, 120, "first epoch")
    return int(re.findall(r"job process pid (\d+)", logs(svc, job_id))[-1])


@pytest.mark.parametrize("sig,cls", [(signal.SIGKILL, "oom"), (signal.SIGSEGV, "crashed")])
def test_a_job_process_killed_behind_its_workers_back_is_not_retried(tight, sig, cls):
    job = tight.submit({**slow_job(epochs=30), "max_attempts": 5})
    os.kill(job_pid(tight, job["id"]), sig)
    done = tight.wait_state(job["id"], timeout=60)
    assert done["state"] == "failed" and done["error"]["class"] == cls, done
    assert done["attempt"] == 1 and len(done["errors"]) == 1
    if cls == "oom":
        assert "SIGKILL" in done["error"]["message"] and "budget 1.50 GiB" in done["error"]["message"]
    else:
        assert "SIGSEGV" in done["error"]["message"]
    assert all(p.poll() is None for p in tight.workers)


def test_the_supervisors_watch_sees_a_process_grow_past_its_budget():
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; b = bytearray(400 << 20); "
                              "sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        watch = memory.Watch(child.pid, budget=300 << 20)
        assert not watch.over() or watch.grown > 300 << 20
        assert child.stdout.readline() == "ready\n"
        assert watch.over() and watch.grown >= 350 << 20
    finally:
        child.kill()
        child.wait()
    assert not watch.over()  # a process that is gone is over nothing


def test_budget_and_message_from_numbers():
    assert memory.budget(None, 0.8, 24 * GiB, 2) == int(0.8 * 24 * GiB / 2)
    assert memory.budget(None, 0.8, 4 * GiB, 8) == memory.MIN_BUDGET
    assert memory.budget(3 * GiB, 0.8, 24 * GiB, 2) == 3 * GiB
    msg = memory.budget_message(3 * GiB, int(3.2 * GiB), "; the worker stopped it")
    assert "budget is 3.00 GiB" in msg and "used 3.20 GiB" in msg and "TRAINYARD_JOB_MEMORY_BYTES" in msg
