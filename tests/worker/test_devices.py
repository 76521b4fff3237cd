"""The /devices payload builder, fed numbers shaped like a real 8x H100 host and like this CPU-only machine;
which GPU a worker's device is (by UUID: mixed hosts, CUDA_VISIBLE_DEVICES's forms, MIG), and why a
worker cannot use its device, from readings shaped like NVML's and torch's."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.gpu_readings import BUILD, CPU, H100, L4, MIG_CARD, GiB, on, worker
from tests.helpers.jobs import tiny_job
from tests.helpers.service import ROOT
from trainyard.app.fleet import devices_payload, gpu_order, hardware, nvml


def test_h100_host():
    nv = [{**H100, "nvml_index": i, "uuid": f"GPU-{i}"} for i in range(8)]
    alloc = {"memory_allocated": 24 * GiB, "memory_reserved": 30 * GiB, "max_memory_allocated": 28 * GiB}
    workers = [worker("w0", "cuda:0", 1000.0, torch=alloc), worker("w1", "cuda:1", 900.0, job=8),
               worker("wc", "cpu", 999.0, state="idle", job=None)]
    p = devices_payload.build_payload(nv, workers, now=1001.0, build=BUILD, cpu=CPU, stale_after_s=15)
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
    nv = [{**H100, "nvml_index": i, "uuid": f"GPU-{i}", "memory_used": i * GiB} for i in range(8)]
    assert gpu_order.visible_indices(8, "5,2") == [5, 2]
    assert gpu_order.visible_indices(8, "") == []
    assert gpu_order.visible_indices(8, "1,9,2") == [1]  # CUDA stops at the first invalid entry
    p = devices_payload.build_payload(nv, [], 0.0, BUILD, CPU, 15, visible=[5, 2])
    assert [(d["index"], d["uuid"]) for d in p["cuda_devices"]] == [(0, "GPU-5"), (1, "GPU-2")]


def test_no_gpu():
    p = devices_payload.build_payload(None, [], 0.0, BUILD, CPU, 15)
    assert p["cuda_available"] is False and p["cuda_devices"] == [] and p["cpu"]["cores"] == 96


def test_this_machine_reads_without_cuda():
    nv = nvml.nvml_devices()
    if Path("/proc/driver/nvidia").exists():  # a GPU host: NVML answers, still without a CUDA context
        assert nv and all(d["name"] and d["memory_total"] > 0 for d in nv)
    else:
        assert nv is None
    info = hardware.torch_build_info()
    assert info["torch_version"].startswith("2.14.1")
    cpu = hardware.cpu_info()
    assert cpu["cores"] >= 1 and cpu["memory_total"] > 0


# ---- several hosts sharing one database ------------------------------------------------------------


def test_two_gpu_hosts_each_with_a_cuda0_worker_and_an_api_host_without_gpus():
    a = [{**H100, "uuid": "GPU-a0", "index": 0}, {**H100, "uuid": "GPU-a1", "index": 1}]
    b = [{**L4, "uuid": "GPU-b0", "index": 0}]
    workers = [on("gpu-a", "wa0", "cuda:0", 1000.0, a, "GPU-a0", job=3),
               on("gpu-a", "wa1", "cuda:1", 1000.0, a, "GPU-a1"),
               on("gpu-b", "wb0", "cuda:0", 1000.0, b, "GPU-b0", cores=8, job=4),
               on("gpu-b", "wbc", "cpu", 1000.0, b, None, cores=8, draining=True)]
    p = devices_payload.build_payload(None, workers, 1001.0, BUILD, CPU, 15, host="api")
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
    nv = [{**H100, "nvml_index": 0, "uuid": "GPU-x", "memory_used": 40 * GiB}]
    stale = [{**H100, "uuid": "GPU-x", "index": 0, "memory_used": 10 * GiB}]
    p = devices_payload.build_payload(nv, [on("box-worker", "w", "cuda:0", 999.0, stale, "GPU-x", job=1)], 1000.0,
                                      BUILD, CPU, 15, host="box-api")
    [gpu] = p["cuda_devices"]
    assert gpu["host"] == "box-worker" and gpu["memory_used"] == 40 * GiB and [w["id"] for w in gpu["workers"]] == ["w"]
    assert [h["host"] for h in p["hosts"]] == ["box-api", "box-worker"] and p["hosts"][0]["cuda_devices"] == []


def test_a_workers_reading_honours_its_cuda_visible_devices(monkeypatch):
    nv = [{**H100, "nvml_index": i, "uuid": f"GPU-{i}", "driver_version": "580.65.06"} for i in range(4)]
    monkeypatch.setattr(nvml, "nvml_devices", lambda: nv)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    r = hardware.host_reading("cuda:1")
    assert r["device_uuid"] == "GPU-1" and [g["index"] for g in r["gpus"]] == [None, 1, None, 0]
    assert r["driver_version"] == "580.65.06" and r["cpu"]["cores"] >= 1
    assert hardware.host_reading("cpu")["device_uuid"] is None
    monkeypatch.setattr(nvml, "nvml_devices", lambda: None)
    # (Two readings differ in the host's available memory: read once.)
    reading = hardware.host_reading("cpu")
    assert reading["gpus"] == [] and reading["device_uuid"] is None and reading["cpu"]["cores"] >= 1


# ---- which GPU a worker's device is: by UUID, whatever the order and the CUDA_VISIBLE_DEVICES -----------

A100 = {"name": "NVIDIA A100-SXM4-40GB", "compute_capability": "8.0", "memory_total": 42_949_672_960,
        "memory_used": 0, "memory_free": 42_949_672_960, "utilization_gpu": 0}
# A mixed host in NVML's (PCI bus) order: the A100 on bus 0x17, the H100 on 0xb3. CUDA's default order,
# fastest first, numbers them the other way round; the worker's warm-up child read torch's UUIDs.
MIXED = [{**A100, "nvml_index": 0, "uuid": "GPU-a1a1a1a1-0000-1111-2222-333333333333", "driver_version": "580.65.06"},
         {**H100, "nvml_index": 1, "uuid": "GPU-b2b2b2b2-4444-5555-6666-777777777777", "driver_version": "580.65.06"}]
TORCH_FASTEST_FIRST = ["b2b2b2b2-4444-5555-6666-777777777777", "a1a1a1a1-0000-1111-2222-333333333333"]


def test_a_mixed_host_matches_torch_devices_to_nvml_by_uuid_not_index(monkeypatch, tmp_path):
    monkeypatch.setattr(nvml, "nvml_devices", lambda: MIXED)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    r = hardware.host_reading("cuda:0", TORCH_FASTEST_FIRST)
    assert r["device_uuid"] == MIXED[1]["uuid"]  # torch's cuda:0 is the H100, NVML's GPU 1
    assert [(g["name"], g["index"]) for g in r["gpus"]] == [(A100["name"], 1), (H100["name"], 0)]
    # Its slot is the H100's: its UUID, its memory (85.5 GB, not the A100's 42.9).
    from trainyard.app.core.settings import Settings
    from trainyard.worker.supervisor.main import Worker
    worker = Worker(Settings(data_dir=tmp_path), "cuda:0")
    slot = worker._slot(r, {"cuda_devices": [{"uuid": u} for u in TORCH_FASTEST_FIRST]})
    assert (slot.key, slot.budget) == (MIXED[1]["uuid"], H100["memory_total"])
    seen = {"torch_version": "2.14.1", "cuda_version": "13.0", "cuda_available": True, "cuda_device_count": 2,
            "cuda_devices": [{"uuid": u} for u in TORCH_FASTEST_FIRST]}
    assert hardware.device_problem("cuda:0", seen, r) is None


def test_cuda_visible_devices_in_its_three_forms(monkeypatch, tmp_path):
    nv = [{**H100, "nvml_index": i, "uuid": f"GPU-{c * 8}-0000-0000-0000-00000000000{i}", "mig_parent": None}
          for i, c in enumerate("abcd")]
    nv[3]["uuid"] = "GPU-aaab0000-0000-0000-0000-000000000003"  # shares the prefix GPU-aaa with GPU 0
    assert gpu_order.visible_indices(nv, "2,0") == [2, 0]
    assert gpu_order.visible_indices(nv, "1gpu,3") == [1, 3]  # each entry's leading number, as CUDA reads it
    assert gpu_order.visible_indices(nv, "2,0,2") == []  # a device named twice: none
    assert gpu_order.visible_indices(nv, f"{nv[2]['uuid']},{nv[1]['uuid']}") == [2, 1]
    assert gpu_order.visible_indices(nv, "GPU-ccc,GPU-aaab") == [2, 3]  # unique prefixes
    assert gpu_order.visible_indices(nv, "GPU-ccc,GPU-aaa,GPU-b") == [2]  # an ambiguous prefix stops the list
    assert gpu_order.visible_indices(nv, "GPU-dead") == []
    mig = [nv[0], *({**A100, "nvml_index": 1, "uuid": f"MIG-{c * 8}-1111-2222-3333-444444444444",
                     "mig_parent": "GPU-parent"} for c in "ef")]
    assert gpu_order.visible_indices(mig, "MIG-ffffffff-1111-2222-3333-444444444444") == [2]
    assert gpu_order.visible_indices(mig, "MIG-fff,MIG-eee") == [2, 1]
    assert gpu_order.visible_indices(mig, "MIG-fff,GPU-aaa") == [2]  # the first entry's form decides

    # An `auto` worker given UUIDs is a GPU worker on the card it names (it used to be a CPU worker).
    monkeypatch.setattr(nvml, "nvml_devices", lambda: nv)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ccc")
    assert gpu_order.visible_cuda_count() == 1
    from trainyard.app.core.settings import Settings
    from trainyard.worker.supervisor.main import Worker
    assert Worker(Settings(data_dir=tmp_path), "auto").device == "cuda:0"
    r = hardware.host_reading("cuda:0")  # before the warm-up's UUIDs: CUDA_VISIBLE_DEVICES parsed
    assert r["device_uuid"] == nv[2]["uuid"] and [g["index"] for g in r["gpus"]] == [None, None, 0, None]


def test_mig_instances_are_gpus_with_their_own_uuid_and_memory(monkeypatch):
    import copy
    nv = nvml.gpu_entries(1, lambda i: copy.deepcopy(MIG_CARD), "570.86.15", "12.8")
    assert [(g["uuid"], g["memory_total"], g["memory_used"], g["mig_parent"]) for g in nv] == [
        (m["uuid"], m["memory_total"], m["memory_used"], MIG_CARD["uuid"]) for m in MIG_CARD["mig"]]
    assert all(g["memory_total"] != MIG_CARD["memory_total"] for g in nv)  # never the parent card's numbers
    assert nv[0]["compute_capability"] == "8.0" and nv[0]["name"].endswith("MIG 3g.20gb")
    monkeypatch.setattr(nvml, "nvml_devices", lambda: nv)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG_CARD["mig"][1]["uuid"])
    r = hardware.host_reading("cuda:0", ["7f3a9b2c-bbbb-5d6e-8f90-222222222222"])  # torch's one device
    assert r["device_uuid"] == MIG_CARD["mig"][1]["uuid"] and [g["index"] for g in r["gpus"]] == [None, 0]
    p = devices_payload.build_payload(nv, [], 0.0, BUILD, CPU, 15)
    assert [g["memory_total"] for g in p["cuda_devices"]] == [20_937_965_568]  # the visible instance only
    # A card in MIG mode without instances is listed, saying why CUDA cannot use it.
    empty = nvml.gpu_entries(1, lambda i: {**copy.deepcopy(MIG_CARD), "mig": []}, "570.86.15")
    assert "no MIG instance" in empty[0]["problem"]


def test_one_failing_gpu_query_marks_that_gpu_unreadable_not_the_whole_list():
    def read(i):
        if i == 1:
            raise RuntimeError("GPU is lost")  # pynvml.NVMLError_GpuIsLost's text
        return {"nvml_index": i, **H100, "uuid": f"GPU-{i}"}
    nv = nvml.gpu_entries(3, read, "580.65.06", "13.0")
    assert [(g["uuid"], g["problem"]) for g in nv] == [("GPU-0", None), (None, "NVML could not read it: GPU is lost"),
                                                       ("GPU-2", None)]
    assert nv[0]["memory_total"] == H100["memory_total"] and nv[1]["memory_total"] is None
    p = devices_payload.build_payload(nv, [], 0.0, BUILD, CPU, 15)
    assert [(g["index"], g["uuid"], g["problem"] is not None) for g in p["cuda_devices"]] == \
        [(0, "GPU-0", False), (1, None, True), (2, "GPU-2", False)]


def test_nvml_is_initialised_once_per_process(monkeypatch):
    calls = []
    real = nvml._init_nvml

    def counted():
        calls.append(1)
        return real()
    monkeypatch.setattr(nvml, "_init_nvml", counted)
    monkeypatch.setitem(nvml._nvml_state, "pid", None)  # as a fresh process
    for _ in range(5):  # five heartbeats' or /devices requests' readings
        nvml.nvml_devices()
        hardware.host_reading("cpu")
    assert len(calls) == 1  # here without a driver: the failure is remembered, not retried at every reading


# ---- a worker that cannot use its device says why, and what to do -------------------------------------------

CU130 = {"torch_version": "2.14.1+cu130", "cuda_version": "13.0", "cudnn_version": "9.24.0"}


def test_the_supervisor_stays_torch_free_through_its_warm_up():
    """The worker's warm-up asks a child of the fork server about torch; its answer must not bring torch into
    the supervisor (an unpickled TorchVersion did: 2 s of CPU and 300 MB at every worker's start)."""
    probe = ("import sys; from trainyard.worker import fork_server; "
             "info = fork_server.warm_up(fork_server.mp_context()); "
             "print(info['torch_version'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    version, imported = out.stdout.split()
    assert version == torch.__version__ and imported == "False", out.stdout


def test_job_processes_start_with_the_preloaded_objects_out_of_the_collectors_sight():
    """The fork server freezes what it preloaded (gc.freeze in worker/warm.py): a job process forked from it
    starts with those objects in the permanent generation, so its full collections skip them."""
    probe = ("import gc; from trainyard.worker import fork_server; pool = fork_server.mp_context().Pool(1); "
             "print(pool.apply(gc.get_freeze_count)); pool.terminate()")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.split()[-1]) > 100_000, out.stdout


def test_a_worker_names_why_it_cannot_use_its_device():
    gpus = [{**H100, "uuid": "GPU-b2b2b2b2-4444-5555-6666-777777777777", "index": None, "nvml_index": 0,
             "mig_parent": None}]
    host = {"gpus": gpus, "driver_version": "570.86.15", "cuda_driver_version": "12.8"}
    old = hardware.device_problem("cuda:0", {**CU130, "cuda_available": False, "cuda_error": (
        "CUDA initialization: The NVIDIA driver on your system is too old (found version 12080).")}, host)
    assert "driver 570.86.15 supports CUDA up to 12.8" in old and "built for CUDA 13.0" in old and "R580" in old
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128" in old and "found version 12080" in old

    none = hardware.device_problem("cuda:0", {**CU130, "cuda_available": False}, {"gpus": [], "driver_version": None})
    assert "no NVIDIA driver" in none and "--gpus" in none and "--device cpu" in none
    cpu_build = hardware.device_problem("cuda:0", {**CU130, "cuda_version": None, "torch_version": "2.14.1+cpu"}, host)
    assert "CPU-only build" in cpu_build
    seen = {**CU130, "cuda_available": True, "cuda_device_count": 1,
            "cuda_devices": [{"uuid": "b2b2b2b2-4444-5555-6666-777777777777"}]}
    missing = hardware.device_problem("cuda:3", seen, host, "1")
    assert "cuda:3 does not exist: torch sees 1 CUDA device(s) under CUDA_VISIBLE_DEVICES='1' (cuda:0..cuda:0)" \
        in missing
    stranger = hardware.device_problem("cuda:0", {**seen, "cuda_devices": [{"uuid": "0000"}]}, host)
    assert "torch and NVML disagree" in stranger and gpus[0]["uuid"] in stranger
    hidden = hardware.device_problem("cuda:0", {**CU130, "cuda_available": False},
                                    {**host, "cuda_driver_version": "13.0"}, "GPU-dead")
    assert "CUDA_VISIBLE_DEVICES='GPU-dead' names none of this host's GPUs" in hidden
    assert hardware.device_problem("cuda:0", seen, host) is None and hardware.device_problem("cpu", {}, {}) is None
    assert "reported nothing" in hardware.device_problem("cuda:0", {}, host)


# ---- a multi-device job's ranks: each pinned by its GPU's UUID ---------------------------------------------

def test_a_ranks_environment_pins_it_to_its_gpu_by_uuid():
    from trainyard.worker import distributed
    pinned = {"CUDA_VISIBLE_DEVICES": "GPU-b2b2b2b2"}
    assert distributed.rank_environment("cuda:0", "GPU-b2b2b2b2") == (pinned, "cuda:0")
    mig = {"CUDA_VISIBLE_DEVICES": "MIG-0e6f2e6a"}
    assert distributed.rank_environment("cuda:3", "MIG-0e6f2e6a") == (mig, "cuda:0")
    assert distributed.rank_environment("cpu", None) == ({}, "cpu")
    assert distributed.rank_environment("cuda:1", None) == ({}, "cuda:1")  # no UUID known: as before


def test_the_lent_devices_uuids_travel_with_the_job_to_its_ranks(tmp_path):
    """Two workers each pinned to one GPU (both `cuda:0`, each under its own CUDA_VISIBLE_DEVICES): the
    2-device job's plan carries each rank's GPU UUID, so rank 1 does not resolve cuda:0 under rank 0's."""
    import os

    from trainyard.app.core.settings import Settings
    from trainyard.app.db import migrate
    from trainyard.app.fleet import placement
    from trainyard.app.fleet import workers as registry
    from trainyard.app.jobs import queue, submit
    from trainyard.app.spec import parse_spec
    from trainyard.worker.supervisor.main import Worker
    settings = Settings(data_dir=tmp_path)
    settings.ensure_dirs()
    ws = [Worker(settings, "cuda:0") for _ in range(2)]
    migrate.prepare(ws[0].engine)
    for w, uuid in zip(ws, ("GPU-a1a1a1a1", "GPU-b2b2b2b2")):
        w.slot = placement.Slot(uuid, gang=2)
        registry.register_worker(w.engine, w.id, settings.node, os.getpid(), w.device, {"slot": {"key": uuid}})
    submit.enqueue(ws[0].engine, parse_spec({**tiny_job(), "device": "cuda", "devices": 2}))
    job = queue.claim(ws[0].engine, ws[0].id, "cuda:0", 30, None, ws[0].slot)
    plan = ws[0].plan(job)
    assert plan.ranks == ("cuda:0", "cuda:0") and plan.rank_uuids == ("GPU-a1a1a1a1", "GPU-b2b2b2b2")
    for w in ws:
        w.engine.dispose()


# ---- a device that fails under a running job: the host's trouble, retried elsewhere -------------------------

def execute(tmp_path, device):
    from trainyard.app.core.states import JobState
    from trainyard.app.records import Job
    from trainyard.worker import runner
    from trainyard.worker.supervisor.plan import JobPlan
    blank = {name: None for name in Job.__dataclass_fields__}
    job = Job(**{**blank, "id": 1, "kind": "train", "state": JobState.RUNNING, "spec": {**tiny_job(), "device": "auto"},
                 "attempt": 1, "claim": 1, "errors": []})
    events = []
    runner.execute(JobPlan(job=job, device=device, data_dir=tmp_path, run_dir=tmp_path / "art",
                           checkpoint_stem=tmp_path / "ck" / "run-1.pt"), events.append)
    [final] = [e for e in events if e["type"] in ("done", "error", "preempted")]
    return final


# CUDA errors as torch raised them on an H200 (tests/fixtures/gpu/record_failures.py): the exception's message,
# after "torch.AcceleratorError: " in the recorded traceback.
RECORDED = json.loads((ROOT / "tests" / "fixtures" / "gpu" / "cuda_failures_h200.json").read_text())


def recorded(case: str) -> str:
    return RECORDED[case]["stderr_tail"].split("Error: ", 1)[1]


def like_recorded(name: str, text: str) -> str:
    """A CUDA error no test can cause on purpose (an ECC fault, a GPU off the bus), in the words torch used for
    the device-side assert it raised for real: only the description and the cudaError name differ."""
    return recorded("device_assert").replace("device-side assert triggered", text).replace("cudaErrorAssert", name)


def test_cuda_errors_are_told_apart_by_their_cudaerror_as_recorded_on_a_gpu():
    from trainyard.worker import torch_devices
    assert_message, ordinal = recorded("device_assert"), recorded("invalid_device_ordinal")
    assert torch_devices.cuda_error(assert_message) == "cudaErrorAssert"  # named by torch itself
    # The job's own faults, as the card raised them: not the device's.
    assert not torch_devices.is_device_failure(torch.AcceleratorError(assert_message))
    assert not torch_devices.is_device_failure(torch.AcceleratorError(ordinal))
    assert not torch_devices.is_device_failure(torch.OutOfMemoryError(recorded("oom")))
    for name, text in torch_devices.DEVICE_ERRORS.items():
        named = like_recorded(name, text)
        assert torch_devices.cuda_error(named) == name
        assert torch_devices.is_device_failure(torch.AcceleratorError(named))
        # Without torch's "Search for" line (as the bad ordinal came), by the runtime's description alone.
        bare = f"CUDA error: {text}\n" + ordinal.split("\n", 1)[1]
        assert torch_devices.cuda_error(bare) == name and torch_devices.is_device_failure(RuntimeError(bare))
    # Words that only a kernel log prints name no cudaError: a job's message quoting them is the job's.
    assert not torch_devices.is_device_failure(RuntimeError("GPU has fallen off the bus"))


@pytest.mark.parametrize("message", [
    like_recorded("cudaErrorECCUncorrectable", "uncorrectable ECC error encountered"),
    "CUDA error: CUDA-capable device(s) is/are busy or unavailable",
    like_recorded("cudaErrorUnknown", "unknown error"),
])
def test_a_device_that_fails_under_a_job_is_an_infrastructure_failure(tmp_path, monkeypatch, message):
    from trainyard.worker import train

    def fails(spec, ctx):
        raise torch.AcceleratorError(message)  # as torch raises them (a RuntimeError)
    monkeypatch.setattr(train, "train", fails)
    error = execute(tmp_path, "cpu")["error"]
    assert (error["class"], error["type"], error["rank"]) == ("infrastructure", "DeviceFailure", 0)
    assert error["message"].startswith(f"device cpu failed: AcceleratorError: {message.splitlines()[0]}")
    # A device this worker does not have (no CUDA here; no 64th GPU on a GPU host): not the job's fault either.
    error = execute(tmp_path, "cuda:63")["error"]
    assert (error["class"], error["type"]) == ("infrastructure", "DeviceFailure") and "cuda:63" in error["message"]


def test_the_job_is_still_the_jobs_own_failure_when_its_code_fails(tmp_path, monkeypatch):
    from trainyard.worker import train

    def fails(spec, ctx):
        raise torch.AcceleratorError(recorded("device_assert"))  # an index out of range in the job's code
    monkeypatch.setattr(train, "train", fails)
    assert execute(tmp_path, "cpu")["error"]["class"] == "job"


# ---- on a GPU: the real thing -------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
def test_the_warm_up_reads_torch_devices_that_nvml_lists_by_uuid():
    """The worker's warm-up child, for real: its torch UUIDs are NVML's GPUs, and cuda:0 is usable."""
    import multiprocessing as mp

    from trainyard.worker import fork_server
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=fork_server.build_info, args=(child,))
    p.start()
    seen = parent.recv()
    p.join()
    nv = nvml.nvml_devices()
    assert seen["cuda_available"] and len(seen["cuda_devices"]) == seen["cuda_device_count"] >= 1
    order = gpu_order.torch_order(nv, [d["uuid"] for d in seen["cuda_devices"]])
    assert None not in order, (seen, nv)
    reading = hardware.host_reading("cuda:0", [d["uuid"] for d in seen["cuda_devices"]])
    assert hardware.device_problem("cuda:0", seen, reading) is None
    own = next(g for g in reading["gpus"] if g["uuid"] == reading["device_uuid"])
    assert own["memory_total"] >= seen["cuda_devices"][0]["total_memory"] * 0.9  # a MIG instance's, if MIG


@pytest.mark.cuda
@cuda
def test_nvml_on_a_gpu_host_is_initialised_once(monkeypatch):
    calls = []
    real = nvml._init_nvml
    monkeypatch.setattr(nvml, "_init_nvml", lambda: calls.append(1) or real())
    monkeypatch.setitem(nvml._nvml_state, "pid", None)
    readings = [nvml.nvml_devices() for _ in range(5)]
    assert len(calls) == 1 and all(readings)
    assert all(g["uuid"] and g["memory_total"] and g["problem"] is None for g in readings[-1])


@pytest.mark.cuda
@cuda
def test_a_rank_pinned_by_uuid_sees_that_gpu_as_cuda0(tmp_path):
    """In a fresh process (CUDA untouched), as a forked rank is: pinned to the last GPU NVML lists, its
    cuda:0 is that GPU."""
    import subprocess
    import sys
    uuid = nvml.nvml_devices()[-1]["uuid"]
    code = ("import torch\nfrom trainyard.worker import distributed, torch_devices\n"
            f"d = torch_devices.resolve(distributed.pin('cuda:5', {uuid!r}))\n"
            "print(torch.cuda.device_count(), str(torch.cuda.get_device_properties(d).uuid))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    count, seen = out.stdout.split()
    assert count == "1" and gpu_order.bare_uuid(seen) == gpu_order.bare_uuid(uuid)
