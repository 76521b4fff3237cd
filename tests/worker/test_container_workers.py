"""The container's workers: the health check reads each worker's own status file (worker/supervisor/status_file.py), the
gpu-workers role gives every GPU entry (MIG instances included) a worker with CUDA_VISIBLE_DEVICES set to its
UUID, and a CUDA job's threads share the host's cores with the other workers' jobs (worker/supervisor/prepare.py).

The health check and the entrypoint run for real (healthcheck.py as a process, entrypoint.sh under bash); the
workers in the entrypoint's tests are a stand-in `trainyard` that records what it was started with, and the
GPUs recorded NVML readings, since no GPU is here. The hung and unavailable workers are real `trainyard worker`
processes.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.gpu_readings import MIG_CARD
from tests.helpers.jobs import tiny_job
from tests.helpers.runner import job_record
from tests.helpers.service import ROOT, Service
from trainyard.app.core.settings import Settings
from trainyard.app.fleet import gpu_order, host_cpu
from trainyard.worker.supervisor import prepare, status_file

HEALTHCHECK = ROOT / "docker" / "healthcheck.py"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"


def healthcheck(pidfile: Path, status_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINYARD_WORKER_PIDFILE": str(pidfile), "TRAINYARD_WORKER_STATUS_DIR": str(status_dir)}
    return subprocess.run([sys.executable, str(HEALTHCHECK), "worker", *flags], env=env, capture_output=True,
                          text=True, timeout=60)


# ---- the health check against real status files --------------------------------------------------

def test_the_health_check_reads_each_workers_status_file(tmp_path):
    """This test's process stands for a worker: it is alive, and it writes its status as a worker does."""
    pidfile, status_dir = tmp_path / "workers.pid", tmp_path / "status"
    pidfile.write_text(f"{os.getpid()}\n")
    missing = healthcheck(pidfile, status_dir)
    assert missing.returncode == 1 and "has written no status" in missing.stderr, missing.stderr

    settings = Settings(data_dir=tmp_path, worker_status_dir=status_dir, lease_s=0.2, heartbeat_s=0.1)
    status_file.write(settings, "idle", None)
    assert healthcheck(pidfile, status_dir).returncode == 0
    status_file.write(settings, "busy", None)
    assert healthcheck(pidfile, status_dir).returncode == 0

    time.sleep(status_file.stale_after_s(settings) + 0.2)  # no heartbeat since: hung
    stale = healthcheck(pidfile, status_dir)
    assert stale.returncode == 1 and f"worker pid {os.getpid()} is hung" in stale.stderr, stale.stderr
    assert healthcheck(pidfile, status_dir, "--liveness").returncode == 1  # hung is not live either

    why = "cuda:0: CUDA is not available: no NVIDIA driver is visible to this process"
    status_file.write(settings, "unavailable", why)
    unavailable = healthcheck(pidfile, status_dir)
    assert unavailable.returncode == 1 and "is unavailable" in unavailable.stderr and why in unavailable.stderr
    # A device that failed under a job: the worker is still busy ending it, and already unavailable.
    status_file.write(settings, "busy", "CUDA error: an illegal memory access was encountered")
    assert healthcheck(pidfile, status_dir).returncode == 1
    # Alive though: a liveness probe that restarted it would forget the failed device and hand it a job.
    assert healthcheck(pidfile, status_dir, "--liveness").returncode == 0

    # Another process's file under this pid's name (a pid reused after a restart) speaks for no one.
    (status_dir / f"{os.getpid()}.json").write_text(json.dumps(
        {"pid": 1, "state": "idle", "unavailable": None, "at": time.time(), "stale_after_s": 60}))
    assert healthcheck(pidfile, status_dir).returncode == 1


# ---- the health check against real workers ------------------------------------------------------

@pytest.mark.slow  # two real workers, each importing torch once
def test_a_hung_worker_and_an_unavailable_one_are_unhealthy(tmp_path):
    status_dir, pidfile = tmp_path / "status", tmp_path / "workers.pid"
    svc = Service(tmp_path / "data", env={"TRAINYARD_LEASE_S": "1", "TRAINYARD_HEARTBEAT_S": "0.25",
                                          "TRAINYARD_WORKER_STATUS_DIR": str(status_dir)})
    bound = status_file.stale_after_s(Settings(data_dir=tmp_path, lease_s=1, heartbeat_s=0.25))
    try:
        svc.start_server()
        cpu = svc.start_worker("cpu")
        pidfile.write_text(f"{cpu.pid}\n")
        assert healthcheck(pidfile, status_dir).returncode == 0
        time.sleep(bound + 1)  # an idle worker's heartbeats keep it healthy past the bound
        assert healthcheck(pidfile, status_dir).returncode == 0

        os.kill(cpu.pid, signal.SIGSTOP)  # alive, and hung
        try:
            time.sleep(bound + 0.5)
            hung = healthcheck(pidfile, status_dir)
            assert hung.returncode == 1 and f"worker pid {cpu.pid} is hung" in hung.stderr, hung.stderr
            assert healthcheck(pidfile, status_dir, "--liveness").returncode == 1
        finally:
            os.kill(cpu.pid, signal.SIGCONT)
        svc.wait_until(lambda: healthcheck(pidfile, status_dir).returncode == 0, 30, "the worker's next heartbeat")

        # This machine has no NVIDIA driver: a cuda:0 worker registers unavailable, saying why.
        gpu = svc.start_worker("cuda:0")
        pidfile.write_text(f"{cpu.pid} {gpu.pid}\n")
        unavailable = healthcheck(pidfile, status_dir)
        assert unavailable.returncode == 1, unavailable.stderr
        assert f"worker pid {gpu.pid} is unavailable" in unavailable.stderr and "no NVIDIA driver" in unavailable.stderr
        assert healthcheck(pidfile, status_dir, "--liveness").returncode == 0  # alive: not restarted, not ready
    finally:
        svc.stop()


# ---- gpu-workers: one worker per NVML entry, each seeing its own ---------------------------------

H100 = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-9a1b2c3d-0000-1111-2222-333333333333",
        "compute_capability": "9.0", "memory_total": 85_520_809_984, "memory_used": 553_648_128,
        "memory_free": 84_967_161_856, "utilization_gpu": 0}
A100_MIG: dict[str, Any] = {k: v for k, v in MIG_CARD.items() if k != "nvml_index"}  # as its NVML handle reads
READINGS = {"driver_version": "580.65.06",
            "cards": [H100, A100_MIG, {"error": "GPU is lost"}]}  # pynvml.NVMLError_GpuIsLost's text
ALL = [H100["uuid"], A100_MIG["mig"][0]["uuid"], A100_MIG["mig"][1]["uuid"], "2"]


def run_entrypoint(tmp_path: Path, env: dict, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """bash entrypoint.sh gpu-workers ARGS with a `trainyard` that records its pid, arguments and environment
    and exits; what each `trainyard worker` was started with, in start order."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record.jsonl"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "trainyard"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"with open({str(record)!r}, 'a') as f:\n"
                    "    f.write(json.dumps({'pid': os.getpid(), 'args': sys.argv[1:],\n"
                    "        'cuda_visible': os.environ.get('CUDA_VISIBLE_DEVICES'),\n"
                    "        'status_dir': os.environ.get('TRAINYARD_WORKER_STATUS_DIR')}) + '\\n')\n")
    fake.chmod(0o755)
    (tmp_path / "readings.json").write_text(json.dumps(READINGS))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "CUDA_VISIBLE"))}
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), clean.get("PATH", "")])
    full = {**clean, "PATH": path, "TRAINYARD_WORKER_PIDFILE": str(tmp_path / "workers.pid"),
            "TRAINYARD_WORKER_STATUS_DIR": str(tmp_path / "status"),
            "TRAINYARD_NVML_READINGS": str(tmp_path / "readings.json"), **env}
    done = subprocess.run(["bash", str(ENTRYPOINT), "gpu-workers", *args], env=full, capture_output=True,
                          text=True, timeout=120)
    started = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return done, started


def test_gpu_workers_gives_each_nvml_entry_its_own_cuda_visible_devices(tmp_path):
    done, started = run_entrypoint(tmp_path, {}, "--max-jobs", "3")
    assert done.returncode == 0, done.stderr
    # One worker per entry: the whole card, each MIG instance (CUDA reaches one only through the variable), and
    # the card NVML could not read by its index (its worker registers unavailable, saying why).
    assert sorted(w["cuda_visible"] for w in started) == sorted(ALL)
    for w in started:
        assert w["args"] == ["worker", "--device", "cuda:0", "--max-jobs", "3"]
        assert w["status_dir"] == str(tmp_path / "status")
    # The pids the health check reads are the workers' own (env execs trainyard).
    assert sorted(map(int, (tmp_path / "workers.pid").read_text().split())) == sorted(w["pid"] for w in started)
    assert (tmp_path / "status").is_dir()


def test_gpu_workers_honours_a_cuda_visible_devices_already_set(tmp_path):
    mig = A100_MIG["mig"][1]["uuid"]
    done, [only] = run_entrypoint(tmp_path, {"CUDA_VISIBLE_DEVICES": mig})
    assert done.returncode == 0, done.stderr
    assert only["cuda_visible"] == mig and only["args"] == ["worker", "--device", "cuda:0"]
    # One worker: the entrypoint exec'd it, so it has the entrypoint's pid, the one in the pid file.
    assert (tmp_path / "workers.pid").read_text().split() == [str(only["pid"])]
    # Integers count cards as NVML does (CUDA_DEVICE_ORDER=PCI_BUS_ID): card 0, and card 1's first instance.
    (tmp_path / "ints").mkdir()
    _, started = run_entrypoint(tmp_path / "ints", {"CUDA_VISIBLE_DEVICES": "1,0"})
    assert sorted(w["cuda_visible"] for w in started) == sorted([A100_MIG["mig"][0]["uuid"], H100["uuid"]])


def test_gpu_workers_on_named_devices_see_what_the_container_sees(tmp_path):
    earlier = tmp_path / "status" / "12345.json"  # an earlier run's worker, whose pid a new one may reuse
    earlier.parent.mkdir()
    earlier.write_text(json.dumps({"pid": 12345, "state": "idle", "at": time.time(), "stale_after_s": 3600}))
    done, started = run_entrypoint(tmp_path, {"TRAINYARD_WORKER_DEVICES": "cuda:0 cuda:2"})
    assert done.returncode == 0, done.stderr
    assert sorted((w["args"], w["cuda_visible"]) for w in started) == [
        (["worker", "--device", "cuda:0"], None), (["worker", "--device", "cuda:2"], None)]
    assert all(w["status_dir"] == str(tmp_path / "status") for w in started)  # for the health check
    assert not earlier.exists()  # it must not speak for a new worker


def test_the_listing_names_each_visible_entry_by_its_uuid():
    gpus = [{"nvml_index": 0, "uuid": H100["uuid"], "mig_parent": None},
            *({"nvml_index": 1, "uuid": m["uuid"], "mig_parent": A100_MIG["uuid"]} for m in A100_MIG["mig"])]
    assert gpu_order.visible_uuids(gpus, "0,1") == [H100["uuid"], A100_MIG["mig"][0]["uuid"]]
    assert gpu_order.visible_uuids(gpus, "MIG-7f3a") == [A100_MIG["mig"][1]["uuid"]]  # a unique prefix, as CUDA
    assert gpu_order.visible_uuids(gpus, "") == []


# ---- a CUDA job's threads -----------------------------------------------------------------------

def test_a_cuda_jobs_threads_share_the_hosts_cores_with_its_other_workers(tmp_path):
    """Eight GPU workers on one host: each CUDA job gets its part of the cores, as CPU jobs do, not all of them."""
    settings = Settings(data_dir=tmp_path, node_name="gpu-host")
    cores = host_cpu.cores()

    def threads(workers: int) -> int | None:
        here = {"all": [{"device": "cuda:0"}] * workers, "cpu": []}
        return prepare.plan_job(job_record({**tiny_job(), "device": "cuda"}), settings, "cuda:0",
                                lambda *a: None, here, None).threads

    assert threads(8) == max(1, cores // 8)
    assert threads(1) == cores
