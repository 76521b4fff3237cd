"""The job process's entry point, importable without torch.

The supervisor pickles a reference to this function for the fork server; importing worker.runner
here (already preloaded in the fork server, so free) keeps torch out of the supervisor.
"""


def run(*args) -> None:
    from trainyard.worker import runner
    runner.run(*args)


def build_info(conn) -> None:
    """Report what the job processes will see: torch, CUDA and cuDNN versions (runs in a child)."""
    import torch
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if cudnn is not None:  # 92400 -> "9.24.0"
        cudnn = f"{cudnn // 10000}.{cudnn % 10000 // 100}.{cudnn % 100}"
    info = {"torch_version": torch.__version__, "cuda_version": torch.version.cuda, "cudnn_version": cudnn,
            "cuda_available": torch.cuda.is_available(),
            "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    conn.send(info)
    conn.close()
