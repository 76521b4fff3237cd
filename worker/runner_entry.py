"""The job process's entry point, importable without torch.

The supervisor pickles a reference to this function for the fork server; importing worker.runner
here (already preloaded in the fork server, so free) keeps torch out of the supervisor.
"""


def run(*args) -> None:
    """runner.run(plan, conn, output) in the job process."""
    from trainyard.worker import runner
    runner.run(*args)


def build_info(conn) -> None:
    """Report what the job processes will see (runs in a child, forked as they are: the one process of
    a worker's start that initialises CUDA): torch, CUDA and cuDNN versions, whether CUDA works and
    why not (torch's warning), and each CUDA device as torch numbers it, with its UUID (the worker
    matches them to NVML's GPUs by UUID, never by index)."""
    import os
    import warnings

    import torch
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if cudnn is not None:  # 92400 -> "9.24.0"
        cudnn = f"{cudnn // 10000}.{cudnn % 10000 // 100}.{cudnn % 100}"
    with warnings.catch_warnings(record=True) as caught:  # "The NVIDIA driver on your system is too old ..."
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    info = {"torch_version": torch.__version__, "cuda_version": torch.version.cuda, "cudnn_version": cudnn,
            "cuda_available": available, "cuda_device_count": 0, "cuda_devices": [],
            "cuda_error": next((str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()),
                               None),
            "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER")}
    if available:
        try:
            info["cuda_device_count"] = torch.cuda.device_count()
            for i in range(info["cuda_device_count"]):
                p = torch.cuda.get_device_properties(i)
                info["cuda_devices"].append({"uuid": str(p.uuid), "name": p.name, "total_memory": p.total_memory})
        except Exception as exc:
            info["cuda_error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
    conn.send(info)
    conn.close()
