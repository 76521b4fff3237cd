"""The job process's contract: whatever happens, exactly one final event, with the failure classified."""
import pytest
import torch

from tests.conftest import tiny_job
from worker import runner, train
from worker.context import JobError, Preempted


def run_job(tmp_path, spec=None):
    events = []
    job = {"id": 1, "spec": spec or tiny_job()}
    paths = {"artifact_dir": str(tmp_path / "art"), "checkpoint_path": str(tmp_path / "ck" / "run-1.pt")}
    (tmp_path / "art").mkdir(exist_ok=True)
    (tmp_path / "ck").mkdir(exist_ok=True)
    runner.execute(job, "cpu", str(tmp_path), paths, events.append)
    final = [e for e in events if e["type"] in ("done", "error", "preempted")]
    assert len(final) == 1, events
    return final[0], events


def test_success_reports_epochs_then_done(tmp_path):
    final, events = run_job(tmp_path)
    assert final["type"] == "done" and final["result"]["epochs"] == 2
    assert [e["epoch"] for e in events if e["type"] == "epoch"] == [1, 2]
    assert (tmp_path / "art" / "model.safetensors").is_file()


@pytest.mark.parametrize("exc,cls", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
    (JobError("cifar_net needs 32x32 images"), "job"),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "job"),
])
def test_failures_are_classified(tmp_path, monkeypatch, exc, cls):
    def boom(spec, ctx):
        raise exc
    monkeypatch.setattr(train, "train", boom)
    final, _ = run_job(tmp_path)
    assert final["type"] == "error" and final["error"]["class"] == cls
    assert final["error"]["type"] == type(exc).__name__ and final["error"]["traceback"]
    if cls == "oom":
        assert "batch_size 32" in final["error"]["message"] and "smaller batch_size" in final["error"]["message"]


def test_preempted(tmp_path, monkeypatch):
    def stop(spec, ctx):
        raise Preempted()
    monkeypatch.setattr(train, "train", stop)
    assert run_job(tmp_path)[0]["type"] == "preempted"


def test_a_spec_the_worker_cannot_parse_is_the_jobs_error(tmp_path):
    final, _ = run_job(tmp_path, spec={**tiny_job(), "model": {"arch": "no-such-net"}})
    assert final["type"] == "error" and final["error"]["class"] == "job"
    assert "no-such-net" in final["error"]["message"]


def test_worker_device_flag_is_validated():
    from worker.main import resolve_device
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:3") == "cuda:3"
    assert resolve_device("auto") == "cpu"  # no NVIDIA driver on this machine
    for bad in ("tpu:0", "cuda:", "gpu", ""):
        with pytest.raises(SystemExit, match="--device must be"):
            resolve_device(bad)
