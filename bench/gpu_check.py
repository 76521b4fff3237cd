"""GPU truth in one command: `make gpu-check` (or `.venv/bin/python -m bench.gpu_check`) on a CUDA host.

Unattended, in a few minutes on a fresh GPU host, it runs:
1. every CUDA-marked test (`pytest -m cuda`);
2. a training job through the real service (server + a `cuda:0` worker): the CIFAR-10 convnet on
   FakeData, checked to succeed on cuda:0 with its allocator peak recorded, then a predict job on it;
3. with two or more GPUs, one job per GPU at once, each on its own worker, and /devices showing each
   GPU (by UUID) with its worker;
4. with two or more GPUs, a 2-device job (DistributedDataParallel over NCCL) on two GPU workers,
   against the same job on one GPU (samples/s of each);
5. the training-throughput benchmark on cuda:0 against the hand-written loops (`--quick`).

It prints one table: the device, driver and torch build, then each check with its figures, and
what it skipped and why. Exit code: 0 all run checks passed, 1 one failed, 2 no CUDA device here
(everything skipped).
"""
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from trainyard.app import hardware
from trainyard.app.launcher import ROOT, Service
from trainyard.app.states import JobState

JOB = {"kind": "train", "name": "gpu-check", "model": {"arch": "cifar_net"},
       "data": {"dataset": "fake", "image_size": [3, 32, 32], "num_classes": 10, "size": 2000},
       "train": {"epochs": 3, "batch_size": 64, "optimizer": "sgd", "lr": 0.01, "momentum": 0.9}}


def environment() -> list[tuple[str, str]]:
    nv = hardware.nvml_devices() or []
    gpus = ", ".join(f"{d['name']} ({d['memory_total'] / 2**30:.0f} GiB)" for d in nv) or "none (NVML)"
    return [("GPUs", gpus), ("driver", nv[0]["driver_version"] if nv else "-"),
            ("torch", f"{torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"),
            ("torch.cuda.device_count()", str(torch.cuda.device_count()))]


def cuda_tests() -> tuple[bool, str]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    summary = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    ok = r.returncode == 0 and "skipped" not in summary
    return ok, f"{summary.strip('= ')} ({time.monotonic() - t0:.0f} s)"


def service_job(devices: list[str]) -> tuple[bool, str]:
    """One training job per device, at once, each on its own worker; then a predict job on the first."""
    svc = Service.isolated(Path(tempfile.mkdtemp(prefix="trainyard-gpu-check-")) / "data")
    try:
        svc.start_server()
        for d in devices:
            svc.start_worker(d, wait=False)
        svc.wait_until(lambda: len(svc.client().get("/workers").json()) == len(devices), 180, "workers")
        t0 = time.monotonic()
        ids = [svc.submit({**JOB, "device": d})["id"] for d in devices]
        jobs = [svc.wait_state(i, timeout=300) for i in ids]
        wall = time.monotonic() - t0
        bad = [j for j in jobs if j["state"] != JobState.SUCCEEDED]
        if bad:
            return False, f"job {bad[0]['id']} {bad[0]['state']}: {bad[0]['error']}"
        parts = []
        for d, j in zip(devices, jobs):
            sps = (j["latest_metrics"] or {}).get("samples_per_s") or 0
            parts.append(f"{d}: acc {j['result']['val_accuracy']:.2f}, {sps:,.0f} samples/s, peak allocated "
                         f"{(j['peak_memory_allocated'] or 0) / 2**20:.0f} MiB")
            if j["device"] != d or (d.startswith("cuda") and not j["peak_memory_allocated"]):
                return False, f"job {j['id']} ran on {j['device']} with peak {j['peak_memory_allocated']}"
        with svc.client() as c:
            devs = c.get("/devices").json()
        held = {g["uuid"] for g in devs["cuda_devices"] if g["workers"]}
        gpus = sum(d.startswith("cuda") for d in devices)
        if len(held) != gpus:
            return False, f"/devices shows {len(held)} GPUs (by UUID) with a worker, not {gpus}"
        pred = svc.wait_state(svc.submit({"kind": "predict", "model_job": ids[0], "device": devices[0],
                                          "inputs": [[128.0] * 3072], "top_k": 3})["id"], timeout=120)
        if pred["state"] != JobState.SUCCEEDED:
            return False, f"predict job {pred['state']}: {pred['error']}"
        return True, f"{'; '.join(parts)}; {wall:.1f} s submit to all succeeded; predict ok"
    except Exception as exc:  # a check that cannot finish is a failed check, with its reason
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    finally:
        svc.stop()


def two_device_job(devices: list[str]) -> tuple[bool, str]:
    """The same job on one device and on two (DDP, half the per-device batch: the same steps), through
    the service on two workers; both must succeed, the second on two distinct devices."""
    svc = Service.isolated(Path(tempfile.mkdtemp(prefix="trainyard-gpu-check-")) / "data")
    kind = "cpu" if devices[0] == "cpu" else "cuda"
    try:
        svc.start_server()
        for d in devices:
            svc.start_worker(d, wait=False)
        svc.wait_until(lambda: len(svc.client().get("/workers").json()) == len(devices), 180, "workers")
        half = {**JOB["train"], "batch_size": JOB["train"]["batch_size"] // 2}
        one = svc.wait_state(svc.submit({**JOB, "device": kind})["id"], timeout=300)
        two = svc.wait_state(svc.submit({**JOB, "device": kind, "devices": 2, "train": half})["id"], timeout=300)
        for j in (one, two):
            if j["state"] != JobState.SUCCEEDED:
                return False, f"job {j['id']} {j['state']}: {j['error']}"
        ranks = [r["device"] for r in two["ranks"] or []]
        if len(ranks) != 2 or (kind == "cuda" and len(set(ranks)) != 2) or two["result"]["devices"] != 2:
            return False, f"the 2-device job ran on {ranks} (result devices {two['result'].get('devices')})"
        rate = lambda j: j["result"]["samples_per_s"] or 0.0  # noqa: E731
        return True, (f"2 ranks on {', '.join(ranks)}: {rate(two):,.0f} samples/s, "
                      f"acc {two['result']['val_accuracy']:.2f}; "
                      f"1 device: {rate(one):,.0f} samples/s, acc {one['result']['val_accuracy']:.2f}; "
                      f"{rate(two) / max(rate(one), 1e-9):.2f}x")
    except Exception as exc:  # a check that cannot finish is a failed check, with its reason
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    finally:
        svc.stop()


def throughput() -> tuple[bool, str]:
    r = subprocess.run([sys.executable, "-m", "bench.train_throughput", "--quick", "--device", "cuda:0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=420)
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "x |" in line]
    if r.returncode != 0 or not rows:
        return False, (r.stderr.strip().splitlines() or ["no table"])[-1][:300]
    ratios = [f"{cells[0]} vs {cells[2]}: {cells[4]}" for cells in
              ([c.strip() for c in row.strip("|").split("|")] for row in rows)]
    return True, "service / hand-written loop, samples/s: " + "; ".join(ratios)


def main() -> int:
    checks: list[tuple[str, str, str]] = []
    if not torch.cuda.is_available():
        why = "no CUDA device here (torch.cuda.is_available() is False)"
        for name in ("CUDA-marked tests", "a training job on cuda:0", "one job per GPU at once", "a 2-device job (DDP)",
                     "throughput on cuda:0"):
            checks.append((name, "skipped", why))
        code = 2
    else:
        n = torch.cuda.device_count()
        checks.append(("CUDA-marked tests", *_status(cuda_tests())))
        checks.append(("a training job on cuda:0 (service)", *_status(service_job(["cuda:0"]))))
        if n >= 2:
            checks.append((f"one job per GPU at once ({n} GPUs)", *_status(service_job([f"cuda:{i}" for i in range(n)]))))
            checks.append(("a 2-device job (DDP, NCCL) vs one GPU", *_status(two_device_job(["cuda:0", "cuda:1"]))))
        else:
            checks.append(("one job per GPU at once", "skipped", "one GPU on this host"))
            checks.append(("a 2-device job (DDP)", "skipped", "one GPU on this host"))
        checks.append(("throughput on cuda:0 (bench.train_throughput --quick)", *_status(throughput())))
        code = 1 if any(status == "FAILED" for _, status, _ in checks) else 0
    print("\n| | |\n|---|---|")
    for k, v in environment():
        print(f"| {k} | {v} |")
    print("\n| check | result | figures, or why |\n|---|---|---|")
    for name, status, detail in checks:
        print(f"| {name} | {status} | {_cell(detail)} |")
    skipped = [name for name, status, _ in checks if status == "skipped"]
    print(f"\n{len(checks) - len(skipped)} checks run, {len(skipped)} skipped" +
          (f": {', '.join(skipped)}" if skipped else ""))
    return code


def _status(outcome: tuple[bool, str]) -> tuple[str, str]:
    return ("passed" if outcome[0] else "FAILED"), outcome[1]


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("|", "/"))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
