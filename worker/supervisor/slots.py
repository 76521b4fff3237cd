"""The slot a worker claims for (app/fleet/placement.py's Slot): its device's key and memory, from the worker's
hardware reading, and NVML's free bytes on its GPU, read again before each look at the queue. Torch-free.
"""
from dataclasses import replace

from trainyard.app.core import device_names
from trainyard.app.core.settings import Settings
from trainyard.app.fleet import gpu_order, nvml, placement

# Free bytes are floored to this: a reading that moves by a few pages is the same slot to the idle look's mark
# and to placement's statement caches (app/fleet/idle_look.py), and it errs on the side of less.
FREE_STEP = 64 << 20


def of(settings: Settings, worker_id: str, device: str, reading: dict, build: dict | None = None) -> placement.Slot:
    """The device this worker claims for: a GPU by its UUID (workers on one GPU share it and its
    memory), the host's CPU when TRAINYARD_DEVICE_MEMORY_GB offers it memory, else its own."""
    budget = int(settings.device_memory_gb * 1e9) if settings.device_memory_gb else None
    if device.startswith("cuda"):
        own = next((g for g in reading["gpus"] if g["uuid"] == reading["device_uuid"]), None)
        # The GPU's UUID (NVML's, else torch's): a multi-device job pins its ranks by it.
        key = reading["device_uuid"] or f"{settings.node}/{device}"
        n = device_names.cuda_index(device)
        seen = (build or {}).get("cuda_devices") or []
        total = own["memory_total"] if own and own.get("memory_total") else \
            seen[n].get("total_memory") if n is not None and n < len(seen) else None
        return placement.Slot(key, budget or total, headroom=settings.gpu_context_headroom_bytes,
                              addr=settings.node_addr)
    return placement.Slot(f"{settings.node}/cpu" if budget else worker_id, budget, addr=settings.node_addr)


def with_free(slot: placement.Slot, device: str) -> placement.Slot:
    """The slot with NVML's free bytes on its GPU now, for the claim (placement.fits_now): a job that would not
    fit beside a context still being freed, or another program's memory, waits. Unchanged off a GPU."""
    if not (device.startswith("cuda") and gpu_order.is_device_uuid(slot.key)):
        return slot
    free = nvml.memory_free(slot.key)
    return replace(slot, free=None if free is None else free // FREE_STEP * FREE_STEP)
