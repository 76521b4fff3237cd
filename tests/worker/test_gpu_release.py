"""A job's GPU memory after its process ends: the worker claims nothing until NVML no longer lists the job's
processes (worker/supervisor/gpu_release.py), placement holds a job to what NVML last saw free on the GPU
(placement.fits_now), and the CUDA context a job costs beyond its statement, measured against the headroom
placement counts (worker/torch_devices/context_size.py).

On the CPU the waits read NVML readings in the shape nvmlDeviceGetComputeRunningProcesses gives them
((pid, used bytes) per GPU), replayed through the wait's reader, with the job's real pid put in; the claims
run on real databases. The tests marked `cuda` do it all on a card.
"""
import logging
import multiprocessing as mp
import re
import time
from datetime import datetime
from pathlib import Path
from typing import cast

import pytest

from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.service import Service
from trainyard.app.core.settings import Settings
from trainyard.app.db import make_engine, migrate
from trainyard.app.fleet import nvml, placement, waiting
from trainyard.app.jobs import queue, submit
from trainyard.app.spec import parse_spec
from trainyard.worker.supervisor import gpu_release
from trainyard.worker.supervisor.job_run import JobRun, WorkerLink
from trainyard.worker.supervisor.plan import JobPlan

GPU, NEIGHBOUR = "GPU-5b1e7f3a-0c2d-4e8f-9a6b-1c3d5e7f9a0b", 424242
GIB, GB = 1 << 30, 10**9
# One killed job's context being torn down, read every 50 ms: listed at its full size, then shrinking as the
# driver frees it, then gone; the neighbour (another worker's job on the card) stays throughout. JOB stands
# for the job's pid.
JOB = -1
TEARDOWN = [[(JOB, 20 * GIB), (NEIGHBOUR, 6 * GIB)], [(JOB, 20 * GIB), (NEIGHBOUR, 6 * GIB)],
            [(JOB, 9 * GIB), (NEIGHBOUR, 6 * GIB)], [(NEIGHBOUR, 6 * GIB)]]
HAS_GPU = bool(nvml.nvml_devices())
on_a_card = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")


def replay(readings: list[list[tuple[int, int | None]]], pid: int, gpu: str = GPU):
    """A reader for wait_for_release: each call the next reading (the last one again once they run out), with
    the job's pid in place of JOB; and the calls it answered."""
    calls: list[float] = []

    def read() -> gpu_release.Reading:
        calls.append(time.monotonic())
        procs = readings[min(len(calls), len(readings)) - 1]
        return {gpu: [(pid if p == JOB else p, used) for p, used in procs]}
    return read, calls


def test_the_wait_holds_while_nvml_lists_the_job_and_ends_once_it_is_gone():
    read, calls = replay(TEARDOWN, pid=31337)
    beats: list[float] = []
    got = gpu_release.wait_for_release({31337}, read, limit_s=30, tick=lambda: beats.append(0), pause_s=0.01)
    assert got is not None and got.freed and got.held == []
    assert len(calls) == 4 and len(beats) == 3  # three reads listing it, a heartbeat after each
    # A neighbour's context on the card is not the job's: it never holds the wait.
    read, calls = replay([[(NEIGHBOUR, 6 * GIB)]], pid=31337)
    assert gpu_release.wait_for_release({31337}, read, limit_s=30).freed and len(calls) == 1
    # No NVML (this host's, without a driver, reads as none): nothing to wait for.
    assert gpu_release.wait_for_release({31337}, lambda: None, limit_s=30) is None
    if not HAS_GPU:
        assert gpu_release.read_nvml([GPU]) is None


def test_the_wait_gives_up_at_its_limit_and_names_what_nvml_still_shows():
    read, _ = replay([[(JOB, 20 * GIB), (7, None)]], pid=31337)
    t0 = time.monotonic()
    got = gpu_release.wait_for_release({31337, 7}, read, limit_s=0.3, pause_s=0.01)
    assert 0.3 <= time.monotonic() - t0 < 2
    assert got is not None and not got.freed and got.waited_s >= 0.3
    assert got.describe() == f"pid 31337 on {GPU}: 20.00 GiB, pid 7 on {GPU}: ?"


class Beats:
    """The worker as a job's supervision sees it (worker/supervisor/job_run.py WorkerLink), reduced to what ending a job
    reaches: its settings, whether it is stopping, and its heartbeat (counted)."""

    def __init__(self, settings: Settings):
        self.id, self.settings, self.stopping = "w1", settings, False
        self.beats: list[tuple[str, int | None]] = []

    def housekeeping(self, state: str, job_id: int | None) -> None:
        self.beats.append((state, job_id))


def killed_gpu_run(tmp_path: Path, wait_s: float) -> tuple[JobRun, Beats]:
    """A job claimed on GPU (the queue's real claim) whose process, a real one forked from a fork server as a
    worker's are, is killed by its supervisor."""
    engine = make_engine(f"sqlite:///{tmp_path / 'q.db'}")
    migrate.upgrade(engine)
    submit.enqueue(engine, parse_spec({**tiny_job(), "device": "cuda"}))
    job = queue.claim(engine, "w1", "cuda:0", 10, None, placement.Slot(GPU, budget=80 * GB))
    engine.dispose()
    assert job is not None and job.gpu_key == GPU
    link = Beats(Settings(data_dir=tmp_path / "data", gpu_release_wait_s=wait_s))
    plan = JobPlan(job=job, device="cuda:0", data_dir=tmp_path, run_dir=tmp_path / "run",
                   checkpoint_stem=tmp_path / "ck" / "run-1.pt")
    ctx = mp.get_context("forkserver")
    events, _ = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=time.sleep, args=(60,))
    proc.start()
    run = JobRun(worker=cast(WorkerLink, link), plan=plan, proc=proc, conn=events, log_path=tmp_path / "job.log")
    run.kill()
    return run, link


def test_a_killed_jobs_worker_waits_for_nvml_to_free_its_memory_and_says_how_long(tmp_path, monkeypatch):
    reader: dict = {}

    def read_nvml(gpus: list[str]) -> gpu_release.Reading:  # the seam: NVML's reading of the job's GPUs
        assert gpus == [GPU]
        return reader["read"]()
    monkeypatch.setattr(gpu_release, "read_nvml", read_nvml)
    run, link = killed_gpu_run(tmp_path, wait_s=30)
    reader["read"], calls = replay(TEARDOWN, pid=run.proc.pid)
    run.end_processes()
    assert len(calls) == 4 and link.beats == [("busy", None)] * 3  # heartbeating, claiming nothing
    line = re.search(r"device memory freed (\d+\.\d) s after the job process ended", run.log_path.read_text())
    assert line is not None and float(line.group(1)) < 5


def test_past_the_limit_the_worker_goes_on_with_a_warning_naming_what_nvml_shows(tmp_path, monkeypatch, caplog):
    pid_of: list[int] = []
    monkeypatch.setattr(gpu_release, "read_nvml",
                        lambda gpus: {GPU: [(pid_of[0], 20 * GIB), (NEIGHBOUR, 6 * GIB)]})
    run, _ = killed_gpu_run(tmp_path, wait_s=0.3)
    pid_of.append(run.proc.pid)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "trainyard.worker"):
        run.end_processes()
    assert 0.3 <= time.monotonic() - t0 < 5
    shown = f"pid {run.proc.pid} on {GPU}: 20.00 GiB"
    assert any(shown in r.getMessage() and "TRAINYARD_GPU_RELEASE_WAIT_S" in r.getMessage() for r in caplog.records)
    assert "device memory not freed" in run.log_path.read_text() and shown in run.log_path.read_text()
    assert str(NEIGHBOUR) not in run.log_path.read_text()


# -- placement: what NVML saw free --------------------------------------------------------------------------------

def stating(engine, gb: float):
    j, _ = submit.enqueue(engine, parse_spec({**tiny_job(), "device": "cuda", "resources": {"gpu_memory_gb": gb}}))
    return j


def test_a_job_that_fits_by_statements_waits_while_nvml_shows_too_little_free(engine):
    """The card's 80 GB, nothing of ours running: a 40 GB job fits by statements alone, but a context still
    being freed (or another program) holds 45 GB: it waits until NVML shows the memory free."""
    job = stating(engine, 40)
    held = placement.Slot(GPU, budget=80 * GB, headroom=GIB, free=35 * GB)
    assert not queue.has_work(engine, "cuda:0", None, "w1", held)
    assert queue.claim(engine, "w1", "cuda:0", 10, None, held) is None
    assert queue.claim(engine, "w1", "cuda:0", 10, None, placement.Slot(GPU, 80 * GB, headroom=GIB,
                                                                         free=40 * GB + GIB - 1)) is None
    freed = placement.Slot(GPU, budget=80 * GB, headroom=GIB, free=79 * GB)
    assert queue.has_work(engine, "cuda:0", None, "w1", freed)
    got = queue.claim(engine, "w1", "cuda:0", 10, None, freed)
    assert got is not None and got.id == job.id


def test_statements_still_count_where_nvml_shows_memory_free(engine):
    """A job claimed a moment ago has allocated nothing: NVML shows the card free, its statement still counts."""
    first, second = stating(engine, 40), stating(engine, 40)
    slot = placement.Slot(GPU, budget=80 * GB, headroom=GIB, free=79 * GB)
    assert queue.claim(engine, "w1", "cuda:0", 10, None, slot).id == first.id
    assert queue.claim(engine, "w2", "cuda:0", 10, None, slot) is None  # 2 x (40 GB + 1 GiB) > 80 GB
    assert queue.claim(engine, "w2", "cuda:0", 10, None, placement.Slot(GPU, 80 * GB, headroom=GIB)) is None
    assert second.state == "queued"


def test_waiting_for_says_when_nvml_is_what_holds_a_job_back(engine):
    job = stating(engine, 40)

    def gpu_worker(state: str, free: int | None) -> dict:
        return {"id": "box-cuda:0", "host": "box", "device": "cuda:0", "state": state, "draining": False,
                "stats": {"slot": {"key": GPU, "budget": 80 * GB, "headroom": GIB, "free": free}}}
    assert waiting.why_waiting(job, [gpu_worker("idle", 30 * GB)]) == (
        "needs 40.0 GB of GPU memory and 1.1 GB for its CUDA context; NVML shows 30.0 GB free on the GPU with the "
        "most (box cuda:0), which runs no job of this service: another program's memory, or a CUDA context still "
        "being freed")
    found = waiting.waiting(job, [gpu_worker("idle", 30 * GB)])
    assert found is not None and found[0] == waiting.Waiting.GPU_MEMORY
    assert waiting.why_waiting(job, [gpu_worker("idle", 60 * GB)]) is None
    assert waiting.why_waiting(job, [gpu_worker("busy", 30 * GB)]) is None  # a job of ours there: its turn
    assert waiting.why_waiting(job, [gpu_worker("idle", None)]) is None  # not read (no NVML)


def test_the_context_is_what_nvml_sees_of_a_fresh_process_beyond_its_allocator():
    from trainyard.worker.torch_devices.context_size import reading
    per_process = reading("cuda:0", GPU, own=700 << 20, before=10 << 30, after=11 << 30, reserved=60 << 20,
                          headroom=GIB)
    assert per_process["how"] == "per process" and per_process["context_bytes"] == 640 << 20
    assert per_process["within_headroom"]
    # NVML's pids are the host's (a container of its own): the card's used memory, after less before.
    by_device = reading("cuda:0", GPU, own=None, before=10 << 30, after=(10 << 30) + (1300 << 20),
                        reserved=60 << 20, headroom=GIB)
    assert by_device["context_bytes"] == 1240 << 20 and by_device["within_headroom"] is False
    assert reading("cuda:0", None, None, None, None, 0, GIB)["context_bytes"] is None


# -- on a card -----------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.slow
@on_a_card
def test_a_fresh_processs_cuda_context_fits_the_headroom_placement_counts():
    from trainyard.worker.torch_devices.context_size import context_reading
    got = context_reading("cuda:0")
    print(got)
    assert got["process_bytes"] is not None and got["process_bytes"] > 0, got
    assert got["reserved_bytes"] > 0 and got["context_bytes"] > 0, got
    assert got["within_headroom"], f"a CUDA context of {got['context_bytes'] / GIB:.2f} GiB is over the headroom " \
                                   f"of {got['headroom_bytes'] / GIB:.2f} GiB (TRAINYARD_GPU_CONTEXT_HEADROOM_BYTES)"


def stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@pytest.mark.cuda
@pytest.mark.slow
@on_a_card
def test_after_a_job_killed_on_a_card_the_next_starts_once_nvml_shows_its_memory_freed(tmp_path):
    svc = Service(tmp_path / "data")
    try:
        svc.start_server()
        svc.start_worker("cuda:0")
        big = svc.submit({**slow_job(epochs=500), "device": "cuda:0",
                          "model": {"arch": "mlp", "hidden": [4096, 4096]}})
        svc.wait_until(lambda: (svc.job(big["id"])["progress"] or {}).get("epoch", 0) >= 1, 300, "its first epoch")
        nxt = svc.submit({**tiny_job(), "device": "cuda:0"})
        with svc.client() as c:
            assert c.post(f"/jobs/{big['id']}/cancel").status_code == 200
        done = svc.wait_state(nxt["id"], timeout=180)
        assert done["state"] == "succeeded"
        with svc.client() as c:
            log = c.get(f"/jobs/{big['id']}/logs").text
        pid = int(re.findall(r"job process pid (\d+)", log)[0])
        freed = re.search(r"device memory freed (\d+\.\d) s after the job process ended", log)
        assert freed is not None, log[-2000:]
        # The next job started after the killed one's process ended (no earlier than its cancel) and its memory
        # was freed; and NVML lists it no more.
        cancelled = svc.job(big["id"])["finished_at"]
        assert stamp(done["started_at"]) >= stamp(cancelled) + float(freed.group(1)) - 0.1
        assert all(pid not in [p for p, _ in nvml.compute_processes(g["uuid"]) or []]
                   for g in nvml.nvml_devices() or [] if g.get("uuid"))
        print(f"device memory freed {freed.group(1)} s after the job process ended")
    finally:
        svc.stop()
