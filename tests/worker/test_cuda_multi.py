"""A job on two GPUs through the real service: its ranks on two distinct GPUs, joined over NCCL (the
backend worker/distributed.py picks on CUDA), its gradients all-reduced between them, one model kept.
Needs two CUDA devices; `trainyard gpu-check` runs it on a host with them."""
import pytest
import torch

from tests.helpers.jobs import slow_job
from tests.helpers.processes import all_gone, job_pids, rank_pids

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def test_a_two_device_job_runs_on_two_gpus_over_nccl(service):
    service.start_worker("cuda:0")
    service.start_worker("cuda:1")
    job = service.submit({**slow_job(epochs=4), "device": "cuda", "devices": 2})
    done = service.wait_state(job["id"], timeout=300)
    assert done["state"] == "succeeded", done
    assert sorted(r["device"] for r in done["ranks"]) == ["cuda:0", "cuda:1"]
    assert len({r["key"] for r in done["ranks"]}) == 2, done["ranks"]  # two GPUs, not one twice
    assert done["result"]["devices"] == 2 and done["result"]["val_accuracy"] > 0.5
    assert done["peak_memory_allocated"] > 0
    assert all_gone(rank_pids(service, job["id"]) + job_pids(service, job["id"]), 10)
