"""The worker's fork server, and the two functions it runs in children: a job process (run) and the
warm-up probe (build_info). Importable without torch.

The supervisor never imports torch and never initialises CUDA; the fork server preloads torch
once, and every child forked from it starts with torch imported and CUDA untouched. The supervisor
pickles references to run() and build_info() for it: importing worker.runner inside them (already
preloaded in the fork server, so free) keeps torch out of the supervisor.
"""
import json
import logging
import multiprocessing as mp
import os
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from typing import Any

log = logging.getLogger("trainyard.worker")


def mp_context() -> ForkServerContext:
    """A fork server with torch preloaded: a plain fork of a process that touched CUDA is unsafe,
    and spawn would pay for `import torch` on every job. "__main__" is whatever started this
    worker (`trainyard`, `python -m trainyard`): a job process that re-imports it then finds it loaded."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "trainyard.worker.runner", "trainyard.worker.warm"])
    return ctx


def pci_bus_order() -> None:
    """CUDA numbers GPUs fastest first unless told otherwise, NVML by PCI bus: on a mixed host the two
    name different cards by one index. PCI bus order for the warm-up and every job process (children
    of this one) makes CUDA_VISIBLE_DEVICES's integers mean what NVML's indices do; the worker's own
    GPU is matched by UUID either way."""
    if os.environ.get("CUDA_DEVICE_ORDER") not in (None, "PCI_BUS_ID"):
        log.warning("CUDA_DEVICE_ORDER=%s replaced by PCI_BUS_ID", os.environ["CUDA_DEVICE_ORDER"])
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"


def warm_up(ctx: ForkServerContext) -> dict[str, Any]:
    """Start the fork server now (it imports torch once, not on the first job) and ask a child
    what torch build the jobs will see (build_info's answer; {} if it died or hung)."""
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=build_info, args=(child,))
    p.start()
    child.close()
    try:
        info = parent.recv() if parent.poll(300) else {}
    except EOFError:  # it died before answering (device_problem says so)
        info = {}
    if not info and p.is_alive():  # a CUDA initialisation that hangs must not hang the worker
        p.kill()
    p.join()
    parent.close()
    return info


def run(*args: Any) -> None:
    """runner.run(plan, conn, output) in the job process."""
    from trainyard.worker import runner
    runner.run(*args)


def build_info(conn: Connection) -> None:
    """Report what the job processes will see (runs in a child, forked as they are: the one process of
    a worker's start that initialises CUDA): torch, CUDA and cuDNN versions, whether CUDA works and
    why not (torch's warning), and each CUDA device as torch numbers it, with its UUID (the worker
    matches them to NVML's GPUs by UUID, never by index)."""
    import warnings

    import torch
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    # 92400 -> "9.24.0"
    cudnn = None if version is None else f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    with warnings.catch_warnings(record=True) as caught:  # "The NVIDIA driver on your system is too old ..."
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    devices: list[dict[str, Any]] = []
    info: dict[str, Any] = {
        "torch_version": torch.__version__, "cuda_version": torch.version.cuda, "cudnn_version": cudnn,
        "cuda_available": available, "cuda_device_count": 0, "cuda_devices": devices,
        "cuda_error": next((str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()), None),
        "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER")}
    if available:
        try:
            info["cuda_device_count"] = count = torch.cuda.device_count()
            for i in range(count):
                p = torch.cuda.get_device_properties(i)
                devices.append({"uuid": str(p.uuid), "name": p.name, "total_memory": p.total_memory})
        except Exception as exc:
            info["cuda_error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
    # Plain values only: torch.__version__ is a TorchVersion, and unpickling one would import torch
    # (2 s, 300 MB) into the supervisor, which is torch-free.
    conn.send(json.loads(json.dumps(info)))
    conn.close()
