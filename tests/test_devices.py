"""The /devices payload builder, fed numbers shaped like a real 8x H100 host and like this CPU-only machine."""
from pathlib import Path

from trainyard.app import hardware as devices

GiB = 2**30
H100 = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0", "compute_capability": "9.0",
        "memory_total": 85_520_809_984, "memory_used": 31 * GiB, "memory_free": 85_520_809_984 - 31 * GiB,
        "utilization_gpu": 97, "driver_version": "580.65.06"}
BUILD = {"torch_version": "2.14.1", "cuda_version": "13.0", "cudnn_version": "9.24.0.43"}
CPU = {"cores": 96, "memory_total": 2 * 1024 * GiB, "memory_available": 1900 * GiB}


def worker(id, device, hb, state="busy", job=7, torch=None):
    return {"id": id, "host": "gpu-host-1", "pid": 100, "device": device, "state": state, "job_id": job,
            "stats": {"torch": torch, "build": {"cudnn_version": "9.24.0"}}, "last_heartbeat": hb}


def test_h100_host():
    nvml = [{**H100, "nvml_index": i, "uuid": f"GPU-{i}"} for i in range(8)]
    alloc = {"memory_allocated": 24 * GiB, "memory_reserved": 30 * GiB, "max_memory_allocated": 28 * GiB}
    workers = [worker("w0", "cuda:0", 1000.0, torch=alloc), worker("w1", "cuda:1", 900.0, job=8),
               worker("wc", "cpu", 999.0, state="idle", job=None)]
    p = devices.build_payload(nvml, workers, now=1001.0, build=BUILD, cpu=CPU, stale_after_s=15)
    assert p["cuda_available"] is True and p["driver_version"] == "580.65.06"
    assert p["torch_version"] == "2.14.1" and p["cuda_version"] == "13.0"
    assert p["cudnn_version"] == "9.24.0"  # what the workers' torch really loaded beats the package version
    assert len(p["cuda_devices"]) == 8
    d0 = p["cuda_devices"][0]
    assert d0["index"] == 0 and d0["compute_capability"] == "9.0" and d0["memory_total"] == 85_520_809_984
    assert d0["memory_used"] + d0["memory_free"] == d0["memory_total"]
    assert d0["workers"][0]["torch"] == alloc and d0["workers"][0]["job_id"] == 7
    assert p["cuda_devices"][1]["workers"][0]["state"] == "lost"  # no heartbeat for 101 s
    assert p["cuda_devices"][2]["workers"] == []
    assert p["cpu"]["cores"] == 96 and [w["id"] for w in p["cpu"]["workers"]] == ["wc"]


def test_cuda_visible_devices_maps_torch_index_to_physical():
    nvml = [{**H100, "nvml_index": i, "uuid": f"GPU-{i}", "memory_used": i * GiB} for i in range(8)]
    assert devices.visible_indices(8, "5,2") == [5, 2]
    assert devices.visible_indices(8, "") == []
    assert devices.visible_indices(8, "1,9,2") == [1]  # CUDA stops at the first invalid entry
    p = devices.build_payload(nvml, [], 0.0, BUILD, CPU, 15, visible=[5, 2])
    assert [(d["index"], d["uuid"]) for d in p["cuda_devices"]] == [(0, "GPU-5"), (1, "GPU-2")]


def test_no_gpu():
    p = devices.build_payload(None, [], 0.0, BUILD, CPU, 15)
    assert p["cuda_available"] is False and p["cuda_devices"] == [] and p["cpu"]["cores"] == 96


def test_this_machine_reads_without_cuda():
    nv = devices.nvml_devices()
    if Path("/proc/driver/nvidia").exists():  # a GPU host: NVML answers, still without a CUDA context
        assert nv and all(d["name"] and d["memory_total"] > 0 for d in nv)
    else:
        assert nv is None
    info = devices.torch_build_info()
    assert info["torch_version"].startswith("2.14.1")
    cpu = devices.cpu_info()
    assert cpu["cores"] >= 1 and cpu["memory_total"] > 0
