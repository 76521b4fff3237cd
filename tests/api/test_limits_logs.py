"""What a job's output and processes may cost the host, done for real: a job printing far past
TRAINYARD_JOB_LOG_BYTES leaves at most that on disk; a big log is read in bounded pieces while the
server's memory stays flat (/proc); a double-forked, setsid'd grandchild ends with its job, with a
job process killed outright, and with a SIGKILLed worker (whose fork server exits too); a run job's
data_dir is a directory of its own, without the service's database.

The run jobs are a plugin this module writes and puts on the workers' PYTHONPATH (entry points
found by importlib.metadata, as for an installed package).
"""
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.processes import gone, peak_rss, reset_peak
from tests.helpers.service import probe_plugin, run_job, serving

pytestmark = pytest.mark.slow
MiB = 1 << 20
CAP = 1 * MiB

PROBES = '''
import os, sys, time


def chatty(ctx, config):
    """Prints config["mib"] MiB: lines through Python and through fd 1 directly, and a progress bar
    redrawn with carriage returns on stderr."""
    print("FIRST LINE", flush=True)
    line = b"x" * 99 + b"\\n"
    block = line * 10_000
    for i in range(config["mib"] * (1 << 20) // len(block)):
        if i % 2:
            os.write(1, block)
        else:
            sys.stdout.write(block.decode())
    for step in range(1, 1001):
        sys.stderr.write(f"\\rbar {step}/1000")
    sys.stderr.write("\\n")
    print("LAST LINE", flush=True)


def daemon(ctx, config):
    """Double-forks a grandchild that leaves the session and sleeps; logs its pid, then returns at once,
    waits for a stop, or sleeps through one (ignore_stop: only SIGKILL ends the job process)."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(write_end, str(os.getpid()).encode())
            time.sleep(300)
        os._exit(0)
    os.waitpid(child, 0)
    os.close(write_end)
    grandchild = int(os.read(read_end, 32))
    ctx.log(f"grandchild pid {grandchild}")
    deadline = time.monotonic() + config.get("wait_s", 0)
    while time.monotonic() < deadline:
        if not config.get("ignore_stop") and ctx.should_stop():
            return None
        time.sleep(0.05)
    return {"grandchild": grandchild}


def scratch(ctx, config):
    """What ctx.data_dir holds, and whether the service's database is reachable through it."""
    found = sorted(str(p.relative_to(ctx.data_dir)) for p in ctx.data_dir.rglob("*"))
    (ctx.data_dir / "mine.bin").write_bytes(b"0" * 1000)
    return {"data_dir": str(ctx.data_dir), "found": found,
            "database": any(p.name.startswith("trainyard.db") for p in ctx.data_dir.rglob("*"))}
'''


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> Path:
    return probe_plugin(tmp_path_factory.mktemp("probes"), "trainyard_probes", PROBES, ("chatty", "daemon", "scratch"))


@pytest.fixture(scope="module")
def live(probes, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("logs") / "data", env={"TRAINYARD_JOB_LOG_BYTES": str(CAP)},
                 worker_env={"PYTHONPATH": str(probes)}) as svc:
        yield svc


def wait_gone(pids: list[int], within: float) -> float:
    t0 = time.monotonic()
    while not all(gone(p) for p in pids):
        assert time.monotonic() - t0 < within, [p for p in pids if not gone(p)]
        time.sleep(0.02)
    return time.monotonic() - t0


def log_text(svc, job_id: int) -> str:
    with svc.client() as c:
        return c.get(f"/jobs/{job_id}/logs").text


def logged_pid(svc, job_id: int, what: str) -> int:
    found: list[str] = []
    def logged() -> list[str]:
        found.extend(re.findall(rf"{what} (\d+)", log_text(svc, job_id)))
        return found

    svc.wait_until(logged, 60, what)
    return int(found[-1])


def test_a_job_printing_far_past_the_cap_leaves_at_most_the_cap_on_disk(live):
    job = live.submit(run_job("chatty", mib=24))
    log, biggest = live.data_dir / "logs" / f"{job['id']}.log", 0
    while live.job(job["id"])["state"] not in ("succeeded", "failed"):
        biggest = max(biggest, log.stat().st_size if log.exists() else 0)
        time.sleep(0.01)
    assert live.job(job["id"])["state"] == "succeeded"
    on_disk = sum(p.stat().st_size for p in (live.data_dir / "logs").iterdir() if p.name.startswith(f"{job['id']}"))
    assert max(biggest, on_disk) <= CAP, (biggest, on_disk)  # 24 MiB printed
    text = log.read_text()
    head, tail = text.split("bytes of output dropped here")
    assert "attempt 1" in head and "FIRST LINE" in head
    assert "LAST LINE" in tail
    dropped = int(re.search(r"\[trainyard: ([\d,]+) $", head).group(1).replace(",", ""))
    assert dropped > 23 * MiB
    # the progress bar's 1,000 drawings are one line: its last
    assert "bar 1000/1000\n" in tail and "bar 999/1000" not in tail


def test_a_big_log_is_read_in_bounded_pieces_with_flat_server_memory(live):
    """Before: one GET of a 419 MB log took the server from 135 MB to 1.82 GB."""
    job = live.wait_state(live.submit(run_job("daemon"))["id"])
    log = live.data_dir / "logs" / f"{job['id']}.log"
    size = 256 * MiB
    with open(log, "r+b") as f:  # a sparse file: 256 MiB to read, next to nothing on disk
        ending = b"second to last line\nthe very last line\n"
        f.truncate(size - len(ending))
        f.seek(size - len(ending))
        f.write(ending)
    pid = live.server.pid
    with live.client() as c:
        r = c.get(f"/jobs/{job['id']}/logs", params={"tail": 30})
        assert r.text == "the very last line\n" and int(r.headers["X-Log-Size"]) == size
        assert int(r.headers["X-Log-Start"]) == size - len(r.content)
        r = c.get(f"/jobs/{job['id']}/logs", params={"offset": size - 19})
        assert r.content == b"the very last line\n"
        r = c.get(f"/jobs/{job['id']}/logs", params={"tail": 10, "offset": 5})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "tail"]
        reset_peak(pid)
        before, received = peak_rss(pid), 0
        with c.stream("GET", f"/jobs/{job['id']}/logs", timeout=httpx.Timeout(60)) as r:
            for chunk in r.iter_raw():
                received += len(chunk)
        grown = peak_rss(pid) - before
    assert received == size
    assert grown < 32 * MiB, f"the server grew {grown / MiB:.0f} MiB reading a {size // MiB} MiB log"


def test_a_double_forked_grandchild_ends_with_its_job(live):
    """Before: a setsid'd grandchild ran 40 s after its job succeeded (to its own end)."""
    job = live.wait_state(live.submit(run_job("daemon"))["id"])
    assert job["state"] == "succeeded"
    grandchild = job["result"]["grandchild"]
    assert wait_gone([grandchild], 2.0) < 2.0


def test_a_grandchild_ends_with_a_job_process_killed_outright(live):
    """Cancel a job that ignores the stop: its process is SIGKILLed, its orphans go to the fork server,
    and the supervisor ends them."""
    job = live.submit(run_job("daemon", wait_s=120, ignore_stop=True))
    grandchild = logged_pid(live, job["id"], "grandchild pid")
    job_process = logged_pid(live, job["id"], "job process pid")
    with live.client() as c:
        assert c.post(f"/jobs/{job['id']}/cancel").status_code == 200
    wait_gone([job_process, grandchild], 5.0)
    assert live.wait_state(live.submit(run_job("daemon"))["id"])["state"] == "succeeded"  # the worker goes on


def test_a_run_jobs_data_dir_is_its_own_and_goes_with_the_run(live):
    job = live.wait_state(live.submit(run_job("scratch"))["id"])
    assert job["state"] == "succeeded", job
    seen = job["result"]
    assert seen["found"] == [] and seen["database"] is False
    here = Path(seen["data_dir"])
    assert here.resolve() != live.data_dir.resolve() and not (here / "trainyard.db").exists()
    live.wait_until(lambda: not here.exists(), 5, "the run's data_dir removed with the run")


def test_nothing_of_a_job_outlives_its_sigkilled_worker(live):
    """Before: the grandchild kept running and kept the dead worker's fork server alive. (Last in the
    module: it kills the service's worker.)"""
    job = live.submit(run_job("daemon", wait_s=120))
    grandchild = logged_pid(live, job["id"], "grandchild pid")
    job_process = logged_pid(live, job["id"], "job process pid")
    fork_server = int(Path(f"/proc/{job_process}/stat").read_text().rsplit(")", 1)[1].split()[1])
    worker = next(w for w in live.workers if fork_server in children(w.pid))
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    wait_gone([grandchild, job_process, fork_server], 5.0)


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
