"""This host's caches, measured and held to their caps: with a bucket store, the data directory's copies
of bucket objects (artifacts, checkpoints, logs, uploads, event files) are a cache, the least recently used
evicted past TRAINYARD_CACHE_BYTES; the decoded datasets under datasets/cache/ are one on every host (evicted by
worker/dataset_cache.py, only measured here).

A copy's mtime is its last use: S3Store.fetch touches a copy it finds here. Evicting deletes the local
file only; the bucket's object stays, and the next fetch downloads it again. Spared: files younger than
the grace (written and not yet published, or just fetched for a job), hidden files (atomic writes'
temporaries, lock files) and anything outside those folders. With the data directory as the store,
the files ARE the store, so nothing is evicted. Torch-free: the API's collector and the worker use it.
"""
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from trainyard.app.core.layout import locked
from trainyard.app.core.storage import Store

COPY_FOLDERS = ("artifacts", "checkpoints", "logs", "datasets/uploads", "tensorboard")
DATASET_CACHE = "datasets/cache"


class Copy(NamedTuple):
    mtime: float
    size: int
    path: Path


def measure(store: Store) -> tuple[int, int]:
    """(bytes, files) of this host's caches: the copies of bucket objects (a bucket store only) and the
    decoded datasets."""
    folders = (*COPY_FOLDERS, DATASET_CACHE) if store.remote else (DATASET_CACHE,)
    found = [c for folder in folders for c in _files(store.layout.root / folder)]
    return sum(c.size for c in found), len(found)


def evict(store: Store, cap_bytes: int, grace_s: float, now: float | None = None) -> list[str]:
    """Delete this host's least recently used copies of bucket objects until they total at most cap_bytes,
    sparing those used or written within grace_s; the keys evicted, oldest first. A no-op for the data
    directory as the store."""
    if not store.remote:
        return []
    now = time.time() if now is None else now
    root = store.layout.root
    evicted: list[str] = []
    # Processes of this host take turns: two evicting at once would each delete what the other already counted out.
    with locked(store.layout.dataset_lock("host-cache")):
        copies = sorted(c for folder in COPY_FOLDERS for c in _files(root / folder))
        total = sum(c.size for c in copies)
        for copy in copies:
            if total <= cap_bytes or copy.mtime > now - grace_s:
                break  # oldest first: every copy after a young one is young too
            outcome = _unlink_unused(copy)
            if outcome != "used":  # a copy used since it was counted stays, and still counts
                total -= copy.size
            if outcome == "evicted":
                evicted.append(store.layout.rel(copy.path))
    return evicted


def _unlink_unused(copy: Copy) -> str:
    """What became of the copy: "evicted"; "used" (fetched or rewritten since it was counted: kept); "gone"."""
    try:
        if os.lstat(copy.path).st_mtime != copy.mtime:
            return "used"
        copy.path.unlink()
        return "evicted"
    except FileNotFoundError:
        return "gone"


def _files(folder: Path) -> Iterator[Copy]:
    """The plain files under folder, hidden ones (and those in hidden folders) left out; what vanishes
    meanwhile is left out too (os.walk passes over folders it cannot list)."""
    for top, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if name.startswith("."):
                continue
            path = Path(top) / name
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield Copy(st.st_mtime, st.st_size, path)
