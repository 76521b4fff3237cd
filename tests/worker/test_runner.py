"""The job process's contract: whatever happens, exactly one final event, with the failure classified."""
import pytest
import torch

from tests.helpers.jobs import tiny_job
from tests.helpers.runner import run_in_process
from trainyard.worker import train
from trainyard.worker.errors import JobError, Preempted


def test_success_reports_epochs_then_done(tmp_path):
    final, events = run_in_process(tmp_path)
    assert final["type"] == "done" and final["result"]["epochs"] == 2
    assert [e["epoch"] for e in events if e["type"] == "epoch"] == [1, 2]
    assert (tmp_path / "art" / "model.safetensors").is_file()


@pytest.mark.parametrize("exc,cls", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                  "you tried to allocate 17179869184 bytes. Error code 12 (Cannot allocate memory)"), "oom"),
    (MemoryError(), "oom"),
    (JobError("cifar_net needs 32x32 images"), "job"),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "job"),
])
def test_failures_are_classified(tmp_path, monkeypatch, exc, cls):
    def boom(spec, ctx):
        raise exc
    monkeypatch.setattr(train, "train", boom)
    final, _ = run_in_process(tmp_path, memory_budget=3 << 30)
    assert final["type"] == "error" and final["error"]["class"] == cls
    assert final["error"]["type"] == type(exc).__name__ and final["error"]["traceback"]
    if isinstance(exc, torch.OutOfMemoryError):
        assert "batch_size 32" in final["error"]["message"] and "smaller batch_size" in final["error"]["message"]
    elif cls == "oom":
        assert "budget is 3.00 GiB" in final["error"]["message"]


def test_preempted(tmp_path, monkeypatch):
    def stop(spec, ctx):
        raise Preempted()
    monkeypatch.setattr(train, "train", stop)
    assert run_in_process(tmp_path)[0]["type"] == "preempted"


def test_a_spec_the_worker_cannot_parse_is_the_jobs_error(tmp_path):
    final, _ = run_in_process(tmp_path, spec={**tiny_job(), "model": {"arch": "no-such-net"}})
    assert final["type"] == "error" and final["error"]["class"] == "job"
    assert "no-such-net" in final["error"]["message"]


def test_worker_device_flag_is_validated(tmp_path):
    from trainyard.app.core.settings import Settings
    from trainyard.worker.supervisor.main import Worker, main
    settings = Settings(data_dir=tmp_path)
    assert Worker(settings, "cpu").device == "cpu" and Worker(settings, "cuda:3").device == "cuda:3"
    for bad in ("tpu:0", "cuda:", "gpu", ""):
        with pytest.raises(SystemExit, match="--device"):
            main(settings, bad)


def test_the_job_s_device_is_made_current_first_and_cublas_is_set_before_cuda(tmp_path, monkeypatch):
    """Every job process makes its device the current one (torch_devices.use_device) before anything runs
    on it, so a CUDA job's bf16 check, a run job's .cuda() and its context land on its own card, not GPU 0;
    a deterministic job has CUBLAS_WORKSPACE_CONFIG set by then, before CUDA is initialised."""
    import os

    from trainyard.worker import entrypoints, torch_devices
    calls = []
    real_use = torch_devices.use_device

    def use_device(device):
        calls.append(("use_device", device, os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
        real_use(device)
    monkeypatch.setattr(torch_devices, "use_device", use_device)
    monkeypatch.setattr(train, "train", lambda spec, ctx: calls.append(("train", ctx.device)) or {})
    monkeypatch.setattr(entrypoints, "run", lambda spec, ctx, attempt: calls.append(("run", ctx.device)) or {})
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    run_in_process(tmp_path)
    assert calls == [("use_device", torch.device("cpu"), ""), ("train", torch.device("cpu"))]
    calls.clear()
    run_in_process(tmp_path, {"kind": "run", "entrypoint": "cifar_loop", "device": "cpu"})
    assert [c[:2] for c in calls] == [("use_device", torch.device("cpu")), ("run", torch.device("cpu"))]
    calls.clear()
    run_in_process(tmp_path, tiny_job(deterministic=True))
    assert calls[0] == ("use_device", torch.device("cpu"), ":4096:8")
