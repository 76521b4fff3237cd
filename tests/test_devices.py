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


# ---- several hosts sharing one database ------------------------------------------------------------

L4 = {"name": "NVIDIA L4", "compute_capability": "8.9", "memory_total": 24 * GiB, "memory_used": 2 * GiB,
      "memory_free": 22 * GiB, "utilization_gpu": 10}


def reading(gpus, own=None, cores=16):
    return {"gpus": gpus, "device_uuid": own, "driver_version": "580.65.06",
            "cpu": {"cores": cores, "memory_total": 128 * GiB, "memory_available": 100 * GiB}}


def on(host, id, device, hb, gpus, own=None, cores=16, job=None, draining=False):
    return {"id": id, "host": host, "pid": 7, "device": device, "state": "busy" if job else "idle", "job_id": job,
            "last_heartbeat": hb, "draining": draining,
            "stats": {"host": reading(gpus, own, cores), "torch": {"memory_allocated": GiB} if job else None}}


def test_two_gpu_hosts_each_with_a_cuda0_worker_and_an_api_host_without_gpus():
    a = [{**H100, "uuid": "GPU-a0", "index": 0}, {**H100, "uuid": "GPU-a1", "index": 1}]
    b = [{**L4, "uuid": "GPU-b0", "index": 0}]
    workers = [on("gpu-a", "wa0", "cuda:0", 1000.0, a, "GPU-a0", job=3), on("gpu-a", "wa1", "cuda:1", 1000.0, a, "GPU-a1"),
               on("gpu-b", "wb0", "cuda:0", 1000.0, b, "GPU-b0", cores=8, job=4),
               on("gpu-b", "wbc", "cpu", 1000.0, b, None, cores=8, draining=True)]
    p = devices.build_payload(None, workers, 1001.0, BUILD, CPU, 15, host="api")
    assert [h["host"] for h in p["hosts"]] == ["api", "gpu-a", "gpu-b"]  # this host first
    api, ha, hb = p["hosts"]
    assert api["cuda_devices"] == [] and api["cpu"]["cores"] == 96 and api["cpu"]["workers"] == []
    assert [(g["uuid"], g["index"], [w["id"] for w in g["workers"]]) for g in ha["cuda_devices"]] == \
        [("GPU-a0", 0, ["wa0"]), ("GPU-a1", 1, ["wa1"])]
    # Both hosts have a cuda:0; each worker is on its own host's card.
    assert [(g["uuid"], g["name"], [w["id"] for w in g["workers"]]) for g in hb["cuda_devices"]] == \
        [("GPU-b0", "NVIDIA L4", ["wb0"])]
    assert hb["cpu"]["cores"] == 8 and [w["id"] for w in hb["cpu"]["workers"]] == ["wbc"]
    assert hb["cpu"]["workers"][0]["draining"] is True
    assert [g["host"] for g in p["cuda_devices"]] == ["gpu-a", "gpu-a", "gpu-b"] and p["cuda_available"]
    assert [w["id"] for w in p["cpu"]["workers"]] == ["wbc"]  # the flat view: every CPU worker


def test_a_gpu_seen_by_the_api_and_by_a_worker_is_one_gpu_with_the_freshest_numbers():
    nvml = [{**H100, "nvml_index": 0, "uuid": "GPU-x", "memory_used": 40 * GiB}]
    stale = [{**H100, "uuid": "GPU-x", "index": 0, "memory_used": 10 * GiB}]
    p = devices.build_payload(nvml, [on("box-worker", "w", "cuda:0", 999.0, stale, "GPU-x", job=1)], 1000.0,
                              BUILD, CPU, 15, host="box-api")
    [gpu] = p["cuda_devices"]
    assert gpu["host"] == "box-worker" and gpu["memory_used"] == 40 * GiB and [w["id"] for w in gpu["workers"]] == ["w"]
    assert [h["host"] for h in p["hosts"]] == ["box-api", "box-worker"] and p["hosts"][0]["cuda_devices"] == []


def test_a_workers_reading_honours_its_cuda_visible_devices(monkeypatch):
    nv = [{**H100, "nvml_index": i, "uuid": f"GPU-{i}", "driver_version": "580.65.06"} for i in range(4)]
    monkeypatch.setattr(devices, "nvml_devices", lambda: nv)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    r = devices.host_reading("cuda:1")
    assert r["device_uuid"] == "GPU-1" and [g["index"] for g in r["gpus"]] == [None, 1, None, 0]
    assert r["driver_version"] == "580.65.06" and r["cpu"]["cores"] >= 1
    assert devices.host_reading("cpu")["device_uuid"] is None
    monkeypatch.setattr(devices, "nvml_devices", lambda: None)
    assert devices.host_reading("cpu") == {**devices.host_reading("cpu"), "gpus": [], "device_uuid": None}
