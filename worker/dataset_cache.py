"""The dataset cache: decoded built-in datasets and FakeData as uint8 tensors, one file each under
the layout's datasets/cache/, the least recently used evicted once they pass dataset_cache_bytes."""
import os
from pathlib import Path

import torch

from trainyard.app.core.settings import get_settings
from trainyard.worker.artifacts import atomic_torch_save


def cache_read(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:  # evicted by another worker just now
        return None
    os.utime(path)  # used: the last to be evicted
    return stored


def cache_write(path: Path, obj: dict, quota: int | None = None) -> None:
    atomic_torch_save(path, obj)
    evict(path.parent, get_settings().dataset_cache_bytes if quota is None else quota, keep=path)


def evict(cache_dir: Path, quota: int, keep: Path) -> list[Path]:
    """Delete the least recently used cache files (never `keep`) until the cache fits in quota.
    A job that has one open keeps reading it: on Linux a deleted file lives on while it is open."""
    files = []
    for p in cache_dir.glob("*.pt"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        files.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in files)
    removed = []
    for _, size, p in sorted(files, key=lambda f: f[0]):
        if total <= quota:
            break
        if p != keep:
            p.unlink(missing_ok=True)
            total -= size
            removed.append(p)
    return removed
