"""Exports of a job's model (ONNX, .pt2, TorchScript): made on the first request, then served from the store.

Owns the API side of GET /jobs/{id}/artifact?format=onnx|pt2|torchscript. The server never imports
torch (nor initialises CUDA), so the export runs in a subprocess on the CPU (worker/export.py),
which writes the file beside the job's artifact; it is published to the store like the artifact,
and every later request (from any server process or host) streams that copy.

What an export costs is a process that imports torch (seconds of CPU, most of a GiB), so nothing
starts one that cannot use it: an artifact without the recipe of its model is refused from its
meta.json, here; a failed export is remembered in a file beside the artifact (`model.onnx.failed`,
published like the export, so every server process and host answers from it: delete it to try
again); an export every requester has hung up on is stopped (its subprocess killed); and at most
`export_queue` exports wait for one of the MAX_CONCURRENT_EXPORTS slots of this process (beyond,
503 with Retry-After).

Why concurrent first requests corrupt nothing: in one process they wait on one export (a task
shared by key). Across processes and hosts each export writes a temporary file and renames it into
place (an S3 PUT is atomic too), so a reader sees a whole file, never half of one; the same model
exports to the same graph, so whichever copy lands last is as good as the first.
"""
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from trainyard.app.core.errors import Conflict, TrainyardError, Unavailable
from trainyard.app.core.layout import ARTIFACT_FILES, EXPORT_FILES
from trainyard.app.core.settings import Settings
from trainyard.app.core.storage import Store
from trainyard.app.records import Job

# A large torchvision model takes a minute or so to export to ONNX on a busy CPU.
EXPORT_TIMEOUT_S = 300
# Each export is a process that imports torch (most of a GiB of memory): a burst of first requests
# for many jobs waits its turn rather than crowding the API host out of memory.
MAX_CONCURRENT_EXPORTS = 2
# How long a stopped export has to remove its temp file (SIGTERM) before it is killed.
STOP_GRACE_S = 2
# worker/export.py's exit statuses: weights saved without what rebuilds the model; the `export` extra
# missing (not remembered as a failure: installing it mends it).
NOT_REBUILDABLE, MISSING_EXTRA = 3, 4
# Beside the export's file: why it failed, as {"status": ..., "detail": ...}.
FAILED_SUFFIX = ".failed"


class ExportFailed(TrainyardError, status=500):
    """The model could not be exported."""


class ExportsBusy(Unavailable, status=503):
    """Too many exports are waiting for a slot; retry after a while."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class Abandoned(TrainyardError, status=499):
    """The client hung up before its export was made (nobody reads this answer)."""


@dataclass
class _Export:
    task: asyncio.Task
    waiters: int = 0


_exports: dict[str, _Export] = {}  # store key -> the export under way in this process
_slots = asyncio.Semaphore(MAX_CONCURRENT_EXPORTS)
_last_s = 10.0  # how long the last export took: the guess at the next one's, for Retry-After


def why_not_rebuildable(meta: dict) -> str | None:
    """Why the model of an artifact with this meta.json cannot be rebuilt to export it; None if it can."""
    if "model" in meta or "spec" in meta:
        return None
    return ("the job saved its weights without the model's arch, input_shape and class_names "
            "(ctx.save_model(model, arch=..., input_shape=..., class_names=...)), so trainyard "
            "cannot rebuild the model to export it")


async def exported(settings: Settings, job: Job, fmt: str, gone: Callable[[], Awaitable[None]]) -> str:
    """The store key of job's model in fmt (a key of EXPORT_FILES), exported first if it is not there yet.
    gone() returns when the client has hung up: the export is stopped if no other request waits for it.
    FileNotFoundError if the job's artifact is missing; Conflict if it cannot be rebuilt; ExportFailed;
    ExportsBusy; Abandoned."""
    key = f"{job.artifact_path}/{EXPORT_FILES[fmt]}"
    export = _exports.get(key)
    if export is None:
        if await asyncio.to_thread(_check, settings, job, key):
            return key
        export = _exports.get(key)  # another request may have started it meanwhile
    if export is None:
        waiting = len(_exports) - MAX_CONCURRENT_EXPORTS  # those beyond the slots wait for one
        if waiting >= settings.export_queue:
            slots_s = _last_s * (waiting // MAX_CONCURRENT_EXPORTS + 1)
            raise ExportsBusy(f"{waiting} exports are waiting for one of {MAX_CONCURRENT_EXPORTS} slots "
                              f"(TRAINYARD_EXPORT_QUEUE={settings.export_queue}); retry later",
                              retry_after=max(1, math.ceil(slots_s)))
        export = _exports[key] = _Export(asyncio.create_task(_export(settings, job, fmt, key)))
        export.task.add_done_callback(lambda _: _exports.pop(key) if _exports.get(key) is export else None)
    export.waiters += 1
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((export.task, watch), return_when=asyncio.FIRST_COMPLETED)
        if not export.task.done():
            raise Abandoned(f"the client hung up before job {job.id}'s {fmt} export was made")
        export.task.result()  # its failure, if it failed
        return key
    finally:
        watch.cancel()
        export.waiters -= 1
        if export.waiters == 0 and not export.task.done():
            export.task.cancel()  # nobody waits for it: kill its subprocess, free its slot


def _check(settings: Settings, job: Job, key: str) -> bool:
    """True if the export is in the store; raises its remembered failure, or Conflict if the artifact's
    meta says the model cannot be rebuilt; False: it is to be made. FileNotFoundError without a meta.json."""
    store = settings.store
    if _stored(store, key):
        return True
    try:
        failed = json.loads(store.read_bytes(key + FAILED_SUFFIX))
    except (FileNotFoundError, ValueError):  # none, or not one of ours: export (and write it anew)
        failed = None
    if isinstance(failed, dict):
        raise (Conflict if failed.get("status") == 409 else ExportFailed)(str(failed.get("detail")))
    try:
        meta = json.loads(store.fetch(f"{job.artifact_path}/{ARTIFACT_FILES['meta']}").read_bytes())
    except ValueError:
        return False  # unreadable: the export says why, and that is remembered
    reason = why_not_rebuildable(meta) if isinstance(meta, dict) else None
    if reason:
        raise Conflict(f"job {job.id} cannot be exported: {reason}")
    return False


def _stored(store: Store, key: str) -> bool:
    try:
        store.size(key)
        return True
    except FileNotFoundError:
        return False


async def _export(settings: Settings, job: Job, fmt: str, key: str) -> None:
    global _last_s
    store = settings.store

    def fetch_artifact() -> None:
        for name in (ARTIFACT_FILES["meta"], ARTIFACT_FILES["safetensors"]):
            store.fetch(f"{job.artifact_path}/{name}")  # from the bucket, when the store is one
    out = settings.layout.resolve(key)
    await asyncio.to_thread(fetch_artifact)
    await _slots.acquire()
    try:
        if await asyncio.to_thread(_stored, store, key):  # made while this one waited (another process)
            return
        started = time.monotonic()
        returncode, err = await _run_export(str(out.parent), fmt, str(out), job.id)
        _last_s = time.monotonic() - started
    except TimeoutError:
        failure: TrainyardError = ExportFailed(f"exporting job {job.id} to {fmt} took longer than {EXPORT_TIMEOUT_S} s")
        await asyncio.to_thread(_remember, store, out, failure)
        raise failure from None
    finally:
        _slots.release()
    lines = err.decode("utf-8", "replace").strip().splitlines()
    reason = lines[-1] if lines else f"the export process exited with status {returncode}"
    if returncode == NOT_REBUILDABLE:
        failure = Conflict(f"job {job.id} cannot be exported: {reason}")
    elif returncode != 0:
        failure = ExportFailed(f"exporting job {job.id} to {fmt} failed: {reason}")
    else:
        await asyncio.to_thread(store.publish, out)
        return
    if returncode in (NOT_REBUILDABLE, 1):  # not MISSING_EXTRA, nor a signal (the OOM killer): those may mend
        await asyncio.to_thread(_remember, store, out, failure)
    raise failure


def _remember(store: Store, out: Path, failure: TrainyardError) -> None:
    """Write failure beside the export's file, atomically, and publish it: later requests answer from it."""
    marker = out.with_name(out.name + FAILED_SUFFIX)
    fd, tmp = tempfile.mkstemp(dir=marker.parent, prefix=f".{marker.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump({"status": failure.status, "detail": str(failure)}, f)
    os.replace(tmp, marker)
    store.publish(marker)


async def _run_export(artifact_dir: str, fmt: str, out: str, job_id: int) -> tuple[int, bytes]:
    """worker/export.py's exit status and stderr; TimeoutError past EXPORT_TIMEOUT_S."""
    # CUDA hidden: an export needs no GPU, and must not take memory on one the workers train on.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trainyard.worker.export", artifact_dir, fmt, out,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), EXPORT_TIMEOUT_S)
    finally:
        if proc.returncode is None:  # timed out, or cancelled: nobody waits for it any more
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    return await proc.wait(), err  # it has exited: wait() only reads its status
