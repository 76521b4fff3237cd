"""NVML readings of real cards, in the shape app/fleet/nvml.py reads them, and workers' rows carrying them, shared
by the tests that replay them."""

# An A100 40GB in MIG mode with two 3g.20gb instances, as NVML reads it (card, then each instance's handle).
MIG_CARD = {"nvml_index": 0, "name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-5c4c7d1e-1111-2222-3333-444444444444",
            "compute_capability": "8.0", "memory_total": 42_949_672_960, "memory_used": 1_300_234_240,
            "memory_free": 41_649_438_720, "utilization_gpu": None,
            "mig": [{"mig_index": 0, "name": "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
                     "uuid": "MIG-0e6f2e6a-aaaa-5c5b-9d8e-111111111111", "memory_total": 20_937_965_568,
                     "memory_used": 13_631_488, "memory_free": 20_924_334_080},
                    {"mig_index": 1, "name": "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
                     "uuid": "MIG-7f3a9b2c-bbbb-5d6e-8f90-222222222222", "memory_total": 20_937_965_568,
                     "memory_used": 4_307_550_208, "memory_free": 16_630_415_360}]}

GiB = 2**30
# An 8x H100 host's first card as NVML reads it, the torch build beside it, and the host's CPU.
H100 = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0", "compute_capability": "9.0",
        "memory_total": 85_520_809_984, "memory_used": 31 * GiB, "memory_free": 85_520_809_984 - 31 * GiB,
        "utilization_gpu": 97, "driver_version": "580.65.06"}
BUILD = {"torch_version": "2.14.1", "cuda_version": "13.0", "cudnn_version": "9.24.0.43"}
CPU = {"cores": 96, "memory_total": 2 * 1024 * GiB, "memory_available": 1900 * GiB}
L4 = {"name": "NVIDIA L4", "compute_capability": "8.9", "memory_total": 24 * GiB, "memory_used": 2 * GiB,
      "memory_free": 22 * GiB, "utilization_gpu": 10}


def worker(id, device, hb, state="busy", job=7, torch=None):
    """A worker's row as /workers lists it, on gpu-host-1."""
    return {"id": id, "host": "gpu-host-1", "pid": 100, "device": device, "state": state, "job_id": job,
            "stats": {"torch": torch, "build": {"cudnn_version": "9.24.0"}}, "last_heartbeat": hb}


def reading(gpus, own=None, cores=16):
    """A worker's reading of its host: its GPUs, its own device's UUID, the CPU."""
    return {"gpus": gpus, "device_uuid": own, "driver_version": "580.65.06",
            "cpu": {"cores": cores, "memory_total": 128 * GiB, "memory_available": 100 * GiB}}


def on(host, id, device, hb, gpus, own=None, cores=16, job=None, draining=False):
    """A worker's row on host with its host's reading (busy with job, if given)."""
    return {"id": id, "host": host, "pid": 7, "device": device, "state": "busy" if job else "idle", "job_id": job,
            "last_heartbeat": hb, "draining": draining,
            "stats": {"host": reading(gpus, own, cores), "torch": {"memory_allocated": GiB} if job else None}}
