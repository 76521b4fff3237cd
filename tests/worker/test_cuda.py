"""What only a GPU can prove about a job on its own card, within its own memory: every test here is marked
`cuda` and skipped without one (`make gpu-check` runs them on a CUDA host). The logic behind each is
tested on the CPU with recorded numbers (tests/worker/test_train.py, test_placement.py, test_runner.py).

Each job runs in a process of its own (spawned, as a worker's fork server gives it a fresh CUDA
context): a memory cap, the current device and cuDNN's switches are process-wide.
"""
import multiprocessing as mp

import pytest
import torch

from tests.helpers.jobs import tiny_job
from tests.helpers.runner import job_record
from trainyard.worker import runner
from trainyard.worker.supervisor.plan import JobPlan

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TERMINAL = ("done", "error", "preempted")


def plan_for(tmp_path, spec: dict, device: str, name: str, fraction: float | None = None) -> JobPlan:
    run_dir, ck = tmp_path / name / "art", tmp_path / name / "ck"
    run_dir.mkdir(parents=True)
    ck.mkdir(parents=True)
    return JobPlan(job=job_record(spec), device=device, data_dir=tmp_path, run_dir=run_dir,
                   checkpoint_stem=ck / "run-1.pt", gpu_memory_fraction=fraction)


class Job:
    """A job process on its device, as a worker starts it; `target` is runner.run or a probe around it."""

    def __init__(self, plan: JobPlan, target=runner.run):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=target, args=(plan, child))
        self.proc.start()
        child.close()

    def final(self, timeout: float = 300) -> dict:
        while True:
            assert self.conn.poll(timeout), "no final event"
            event = self.conn.recv()
            if event["type"] in TERMINAL:
                self.proc.join(30)
                return event


def capped(gb: float, device: int = 0) -> float:
    """The memory fraction that holds a job to gb GB on the device (resources.gpu_memory_gb)."""
    return gb * 1e9 / torch.cuda.get_device_properties(device).total_memory


def test_a_job_over_its_memory_cap_fails_oom_while_its_neighbour_on_the_card_finishes(tmp_path):
    # 12288 -> 8192 -> 8192: 168 M parameters, 0.67 GB of weights, 2.7 GB with Adam's state and the
    # gradients, held to 1 GB; beside it a small job held to 2 GB on the same card.
    big = {"kind": "train", "device": "cuda:0", "model": {"arch": "mlp", "hidden": [8192, 8192]},
           "data": {"dataset": "fake", "image_size": [3, 64, 64], "num_classes": 10, "size": 512},
           "train": {"epochs": 2, "batch_size": 64}}
    small = {**tiny_job(epochs=30), "device": "cuda:0"}
    over = Job(plan_for(tmp_path, big, "cuda:0", "big", capped(1)))
    within = Job(plan_for(tmp_path, small, "cuda:0", "small", capped(2)))
    failed, done = over.final(), within.final()
    assert failed["type"] == "error" and failed["error"]["class"] == "oom", failed
    assert "CUDA out of memory on cuda:0" in failed["error"]["message"]
    assert done["type"] == "done", done
    assert done["result"]["peak_memory_reserved"] <= 2e9


def test_compile_on_the_device_with_channels_last(tmp_path):
    spec = {"kind": "train", "device": "cuda:0", "model": {"arch": "cnn", "channels": [16, 32]},
            "data": {"dataset": "digits"},
            "train": {"epochs": 2, "batch_size": 64, "compile": True, "channels_last": True}}
    done = Job(plan_for(tmp_path, spec, "cuda:0", "compiled")).final()
    assert done["type"] == "done", done
    applied = done["result"]["applied"]
    assert applied["compile"] == "on" and "compile_error" not in applied, applied
    assert applied["channels_last"] == "on" and applied["data"] == "on the device"


def test_a_dataset_kept_in_host_memory_is_compiled_on_the_device(tmp_path):
    # 12,000 x 3x32x32 float32: 147 MB, over half of a 0.25 GB budget: it stays in host memory, and
    # batches are copied. The warm-up batch must be on the device too, or compile silently fails.
    spec = {"kind": "train", "device": "cuda:0", "model": {"arch": "cnn", "channels": [8]},
            "data": {"dataset": "fake", "image_size": [3, 32, 32], "num_classes": 10, "size": 12_000},
            "train": {"epochs": 1, "batch_size": 128, "compile": True}}
    done = Job(plan_for(tmp_path, spec, "cuda:0", "hosted", capped(0.25))).final()
    assert done["type"] == "done", done
    applied = done["result"]["applied"]
    assert applied["data"] == "in host memory", applied
    assert applied["compile"] == "on" and "compile_error" not in applied, applied


def _probe(plan: JobPlan, conn) -> None:
    """The job, in this process (runner.execute), then what it left: the current device, where a bare
    .cuda() lands, and which GPUs hold a CUDA context of this process (NVML)."""
    import os

    import pynvml
    events: list = []
    runner.execute(plan, events.append)
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    contexts = [str(pynvml.nvmlDeviceGetUUID(h)) for h in handles
                if any(p.pid == os.getpid() for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h))]
    # By UUID: NVML numbers GPUs in PCI order, CUDA fastest first.
    own = str(torch.cuda.get_device_properties(plan.device).uuid)
    conn.send({"type": "done", "final": events[-1], "current": torch.cuda.current_device(),
               "bare": torch.ones(1).cuda().device.index, "contexts": [u.endswith(own) for u in contexts]})
    conn.close()


def test_set_device_and_bf16_on_the_jobs_own_card(tmp_path):
    # The last card: with two or more, not GPU 0 (with one, the test still runs the path).
    last = torch.cuda.device_count() - 1
    spec = {**tiny_job(epochs=2, precision="bf16"), "device": f"cuda:{last}"}
    probe = Job(plan_for(tmp_path, spec, f"cuda:{last}", "own"), target=_probe).final()
    assert probe["final"]["type"] == "done", probe
    assert probe["current"] == probe["bare"] == last
    # A CUDA context on the job's card only, none on GPU 0 (empty: NVML shows another PID namespace's pids).
    assert probe["contexts"] in ([True], [])
    bf16 = torch.cuda.get_device_capability(last) >= (8, 0)
    assert probe["final"]["result"]["applied"]["precision"] == ("bf16" if bf16 else "fp32")
