"""How much GPU memory a job process costs outside its allocator: its CUDA context (the driver's code and data,
cuBLAS's and cuDNN's handles and workspaces), measured in a fresh process, against the headroom placement
counts for each job beside its statement (TRAINYARD_GPU_CONTEXT_HEADROOM_BYTES, app/fleet/placement.py).

`context_bytes(device)` and `context_reading(device)` start a fresh Python process for it (a process that
already holds a context, or whose allocator holds memory, would measure itself); run as
`python -m trainyard.worker.torch_devices.context_size cuda:0`, it prints the reading as JSON.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from trainyard.app.core.settings import Settings
from trainyard.app.fleet import gpu_order, nvml


def nvml_uuid(device: torch.device) -> str | None:
    """NVML's UUID (GPU-... or MIG-...) of torch's device, matched as the worker matches them; None without NVML."""
    listed = nvml.nvml_devices() or []
    at = gpu_order.torch_order(listed, [str(torch.cuda.get_device_properties(device).uuid)])[0]
    return None if at is None else listed[at]["uuid"]


def measure(device: str) -> dict:
    """In this process, which must not have started CUDA yet: NVML's reading of its memory on `device` after
    CUDA's start, a cuBLAS matmul and a cuDNN convolution, each in a training step (forward, backward, a fused
    AdamW step: the kernels every training job loads), less what its allocator reserved (that part lies
    within a job's cap). Per process where NVML lists this pid, else the change in the GPU's used memory
    (NVML's pids are the host's: a container without --pid=host)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"{device}: only a CUDA device has a CUDA context to measure")
    uuid = nvml_uuid(dev)
    before = _used(uuid)
    torch.cuda.set_device(dev)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(16 * 32 * 32, 1024), torch.nn.Linear(1024, 10)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    loss = torch.nn.functional.cross_entropy(model(torch.randn(64, 3, 32, 32, device=dev)),
                                             torch.randint(0, 10, (64,), device=dev))
    loss.backward()
    opt.step()
    torch.cuda.synchronize(dev)
    own = next((used for pid, used in (nvml.compute_processes(uuid) or []) if pid == os.getpid()), None) \
        if uuid else None
    after = _used(uuid)
    return reading(device, uuid, own, before, after, torch.cuda.memory_reserved(dev),
                   Settings().gpu_context_headroom_bytes)


def reading(device: str, uuid: str | None, own: int | None, before: int | None, after: int | None,
            reserved: int, headroom: int) -> dict:
    """The measurement from NVML's numbers (pure): the process's bytes (NVML's per-process figure, else the
    GPU's used memory after less before), the context (those less the allocator's reserved bytes) and the
    headroom it is held against."""
    process, how = (own, "per process") if own is not None else \
        (after - before, "device used, after less before") if after is not None and before is not None else (None, None)
    context = None if process is None else max(0, process - reserved)
    return {"device": device, "uuid": uuid, "how": how, "process_bytes": process, "reserved_bytes": reserved,
            "context_bytes": context, "headroom_bytes": headroom,
            "within_headroom": None if context is None else context <= headroom}


def _used(uuid: str | None) -> int | None:
    gpus = [g for g in nvml.nvml_devices() or [] if uuid and g.get("uuid") == uuid]
    return gpus[0].get("memory_used") if gpus else None


def context_reading(device: str = "cuda:0", timeout_s: float = 120) -> dict:
    """measure() in a fresh Python process (this one may hold a context already)."""
    # Where this process found trainyard (a checkout, or the wheel), for the child to find it too: the folder
    # that holds trainyard/ (this file is trainyard/worker/torch_devices/context_size.py; links not resolved).
    root = str(Path(__file__).absolute().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-m", "trainyard.worker.torch_devices.context_size", device],
                          capture_output=True, text=True, timeout=timeout_s, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"measuring the CUDA context on {device} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def context_bytes(device: str = "cuda:0") -> int:
    """The bytes a fresh job process holds on `device` outside its allocator once CUDA, cuBLAS and cuDNN have
    started (context_reading); raises when NVML cannot tell."""
    found = context_reading(device)
    if found["context_bytes"] is None:
        raise RuntimeError(f"NVML could not measure the CUDA context on {device}: {found}")
    return int(found["context_bytes"])


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1] if len(sys.argv) > 1 else "cuda:0")))
