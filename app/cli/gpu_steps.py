"""The processes of `trainyard gpu-check`'s checks (app/cli/gpu_check.py runs them, each under a time limit):
`python -m trainyard.app.cli.gpu_steps CHECK ARGS` prints its one line of figures (or why it failed)
last, and exits 0 when it passed. Only these processes import torch (the probe) or run jobs."""
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.app.core.states import JobState
from trainyard.app.launcher import Service

JOB: dict[str, Any] = {"kind": "train", "name": "gpu-check", "model": {"arch": "cifar_net"},
       "data": {"dataset": "fake", "image_size": [3, 32, 32], "num_classes": 10, "size": 2000},
       "train": {"epochs": 3, "batch_size": 64, "optimizer": "sgd", "lr": 0.01, "momentum": 0.9}}


def job(device: str, **over) -> dict:
    """JOB on the device; on the CPU (`--device cpu`, a rehearsal of the plumbing, not of the figures) on a
    fifth of the images."""
    data = {**JOB["data"], "size": JOB["data"]["size"] // (5 if device == "cpu" else 1)}
    return {**JOB, "data": data, "device": device, **over}


def failed(*jobs: dict) -> str | None:
    """The first of jobs that did not succeed, as a check's line; None when all did."""
    bad = [j for j in jobs if j["state"] != JobState.SUCCEEDED]
    return f"job {bad[0]['id']} {bad[0]['state']}: {bad[0]['error']}" if bad else None


def rate(j: dict) -> float:
    """A finished training job's mean samples per second."""
    return j["result"]["samples_per_s"] or 0.0


def started(devices: list[str], env: dict | None = None, worker_env: dict | None = None) -> Service:
    """A service of its own in this check's folder (gpu-check's TMPDIR), a worker on each of devices, all
    registered. The caller stops it."""
    svc = Service.isolated(Path(tempfile.mkdtemp(prefix="service-")) / "data", env=env)
    try:
        svc.start_server()
        for d in devices:
            svc.start_worker(d, wait=False, env=worker_env)
        svc.wait_until(lambda: len(svc.client().get("/workers").json()) == len(devices), 180, "workers")
    except BaseException:
        svc.stop()
        raise
    return svc


def artifact(svc: Service, job_id: int) -> dict:
    """A succeeded train job's weights, by name."""
    from safetensors.torch import load
    with svc.client() as c:
        return load(c.get(f"/jobs/{job_id}/artifact").content)


def weights_apart(w1: dict, w2: dict) -> float:
    """How far apart two state dicts are: the largest difference of any weight over the largest weight
    (inf when their names differ)."""
    if w1.keys() != w2.keys():
        return float("inf")
    scale = max(w.abs().max().item() for w in w1.values()) or 1.0
    return max((w1[k].float() - w2[k].float()).abs().max().item() for k in w1) / scale


def probe() -> tuple[bool, str]:
    import torch  # this process only: the command stays torch-free, and a hung CUDA init hangs only this

    from trainyard.app.fleet.nvml import nvml_devices
    nvml = nvml_devices() or []
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "driver": f"{nvml[0].get('driver_version')} (supports CUDA {nvml[0].get('cuda_driver_version')})"
            if nvml else None, "nvml": nvml, "names": [], "cuda_count": 0,
            "why": "torch.cuda.is_available() is False" + ("" if nvml else "; no NVIDIA driver (NVML)")}
    if torch.version.cuda is None:
        info["why"] = f"torch {torch.__version__} is a CPU-only build"
    elif torch.cuda.is_available():
        info["cuda_count"] = torch.cuda.device_count()
        info["names"] = [torch.cuda.get_device_name(i) for i in range(info["cuda_count"])]
        x = torch.ones(1024, device="cuda:0")
        assert (x + x).sum().item() == 2048  # a context, a kernel, a copy back
    return True, json.dumps(info)


def cuda_tests(device: str, *files: str) -> tuple[bool, str]:
    if not files:
        return False, "no CUDA-marked tests found in tests/"
    t0 = time.monotonic()
    # On the CPU (a rehearsal) they are collected only: found, and importable with what is installed.
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rfEs", "-p", "no:cacheprovider",
                        "--tb=short", "--durations=10",
                        *(["--collect-only"] if device == "cpu" else []), *files], capture_output=True, text=True)
    # The whole report stays in the check's folder, which gpu-check keeps and names when the check fails.
    Path(tempfile.gettempdir(), "cuda-tests.log").write_text(r.stdout + r.stderr)
    lines = r.stdout.strip().splitlines() or ["(no output)"]
    summary = f"{lines[-1].strip('= ')} ({time.monotonic() - t0:.0f} s)"
    failures = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    if r.returncode != 0:
        return False, "; ".join(failures[:3] + [summary])
    if device != "cpu" and " passed" not in summary:
        return False, f"no CUDA test ran: {summary}; {'; '.join(ln for ln in lines if ln.startswith('SKIPPED'))[:300]}"
    return True, summary


def service_job(*devices: str) -> tuple[bool, str]:
    """One training job per device, at once, each on its own worker; then a predict job on the first."""
    svc = started(list(devices))
    try:
        t0 = time.monotonic()
        ids = [svc.submit(job(d))["id"] for d in devices]
        jobs = [svc.wait_state(i, timeout=3600) for i in ids]
        wall = time.monotonic() - t0
        if why := failed(*jobs):
            return False, why
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
                                          "inputs": [[128.0] * 3072], "top_k": 3})["id"], timeout=3600)
        if pred["state"] != JobState.SUCCEEDED:
            return False, f"predict job {pred['state']}: {pred['error']}"
        return True, f"{'; '.join(parts)}; {wall:.1f} s submit to all succeeded; predict ok"
    finally:
        svc.stop()


def two_device_job(*devices: str) -> tuple[bool, str]:
    """The same job on one device and on two (DDP, half the per-device batch: the same steps), through
    the service on two workers; both must succeed, the second on two distinct devices."""
    kind = "cpu" if devices[0] == "cpu" else "cuda"
    svc = started(list(devices))
    try:
        half = {**JOB["train"], "batch_size": JOB["train"]["batch_size"] // 2}
        one = svc.wait_state(svc.submit(job(kind))["id"], timeout=3600)
        two = svc.wait_state(svc.submit(job(kind, devices=2, train=half))["id"], timeout=3600)
        if why := failed(one, two):
            return False, why
        ranks = [r["device"] for r in two["ranks"] or []]
        if len(ranks) != 2 or (kind == "cuda" and len(set(ranks)) != 2) or two["result"]["devices"] != 2:
            return False, f"the 2-device job ran on {ranks} (result devices {two['result'].get('devices')})"
        return True, (f"2 ranks on {', '.join(ranks)}: {rate(two):,.0f} samples/s, "
                      f"acc {two['result']['val_accuracy']:.2f}; "
                      f"1 device: {rate(one):,.0f} samples/s, acc {one['result']['val_accuracy']:.2f}; "
                      f"{rate(two) / max(rate(one), 1e-9):.2f}x")
    finally:
        svc.stop()


def two_host_job(*devices: str) -> tuple[bool, str]:
    """The same 2-rank job on two devices of one host, then over two hosts: network namespaces on a bridge of
    their own (app/cli/netns.py), one worker and one device in each, the ranks meeting at rank 0's address;
    NCCL between them on GPUs (NCCL_HOSTID set apart, so that NCCL talks over its network transport as between
    machines, not through shared memory), gloo on the CPU. The hosts share the server's SQLite database and
    data directory, as hosts share PostgreSQL and a bucket. Both must succeed, the second with a rank on each
    host, and end with the same weights within float tolerance (cuDNN's kernels need not be deterministic)."""
    from trainyard.app.cli import netns
    svc = Service.isolated(Path(tempfile.mkdtemp(prefix="service-")) / "data")
    kind = "cpu" if devices[0] == "cpu" else "cuda"
    half = {**JOB["train"], "batch_size": JOB["train"]["batch_size"] // 2}
    try:
        svc.start_server()
        for d in devices:  # this host's workers: no address, so they never take a part of a job across hosts
            svc.start_worker(d)
        one = svc.wait_state(svc.submit(job(kind, devices=2, train=half))["id"], timeout=3600)
        with netns.hosts(2) as net:
            for h, d in zip(net.hosts, devices):
                # eth0: each namespace's one link (app/cli/netns.py), whatever interface this shell names.
                net.start_worker(svc, h, {"TRAINYARD_NODE_ADDR": h.addr, "NCCL_HOSTID": h.name, "GLOO_SOCKET_IFNAME":
                                          "eth0", "NCCL_SOCKET_IFNAME": "eth0"}, device=d)
            two = svc.wait_state(svc.submit(job(kind, devices=2, hosts=2, train=half))["id"], timeout=3600)
            names = {h.name for h in net.hosts}
        if why := failed(one, two):
            return False, why
        hosts = [r.get("host") for r in two["ranks"] or []]
        if set(hosts) != names:
            return False, f"the 2-host job's ranks ran on hosts {hosts}, not one on each of {sorted(names)}"
        diff = weights_apart(artifact(svc, one["id"]), artifact(svc, two["id"]))
        where = ", ".join(f"{r['device']}@{r['host']}" for r in two["ranks"])
        line = (f"ranks on {where}: "
                f"{rate(two):,.0f} samples/s; one host: {rate(one):,.0f} samples/s "
                f"({rate(two) / max(rate(one), 1e-9):.2f}x); weights apart by {diff:.1e} of their largest")
        return diff <= 1e-2, line if diff <= 1e-2 else f"the weights differ: {line}"
    finally:
        svc.stop()


def throughput(device: str) -> tuple[bool, str]:
    """bench.train_throughput --quick: the service against the hand-written loops. On a GPU, where the bench has
    them, the image cases (ResNet-18, bf16, channels_last, eager and compiled) and cifar_net at batch 64 only: the
    launch-bound small cases have been measured on every card before, and a lent card's minutes are few."""
    cases = []
    if device != "cpu":
        try:
            from bench.cases import GROUPS
            cases = ["--cases", ",".join(["cifar_net-b64", *GROUPS["image"]])]
        except (ImportError, KeyError):  # a bench/ from before the image cases: its default cases
            pass
    r = subprocess.run([sys.executable, "-m", "bench.train_throughput", "--quick", "--device", device, *cases],
                       capture_output=True, text=True)
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "x |" in line]
    if r.returncode != 0 or not rows:
        return False, (r.stderr.strip().splitlines() or ["no table"])[-1]
    parts = []
    for cells in ([c.strip() for c in row.strip("|").split("|")] for row in rows):
        # Columns 0-4: case, service samples/s, yardstick, its samples/s, the ratio; MFU last, where the bench has it.
        mfu = f", MFU {cells[-2]} vs {cells[-1]}" if len(cells) >= 12 and cells[-2] not in ("-", "n/a") else ""
        parts.append(f"{cells[0]} vs {cells[2]}: {cells[4]} ({cells[1]} vs {cells[3]} samples/s{mfu})")
    return True, "service / hand-written loop: " + "; ".join(parts)


STEPS: dict[str, Callable[..., tuple[bool, str]]] = {
    "probe": probe, "cuda-tests": cuda_tests, "service": service_job, "ddp": two_device_job, "hosts": two_host_job,
    "throughput": throughput}

def main(steps: dict[str, Callable[..., tuple[bool, str]]]) -> None:
    """`python -m MODULE CHECK ARGS`: run one of steps, print its line last, exit 0 when it passed."""
    try:
        passed, line = steps[sys.argv[1]](*sys.argv[2:])
    except Exception as exc:  # a check that cannot finish is a failed check, with its reason on one line
        passed, line = False, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
    print(line)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main(STEPS)
