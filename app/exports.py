"""Exports of a job's model (ONNX, .pt2, TorchScript): made on the first request, then served from the store.

Owns the API side of GET /jobs/{id}/artifact?format=onnx|pt2|torchscript. The server never imports
torch (nor initialises CUDA), so the export runs in a subprocess on the CPU (worker/export.py),
which writes the file beside the job's artifact; it is published to the store like the artifact,
and every later request (from any server process or host) streams that copy.

Why concurrent first requests corrupt nothing: in one process they share a lock, so one exports
and the others find its file. Across processes and hosts each export writes a temporary file and
renames it into place (an S3 PUT is atomic too), so a reader sees a whole file, never half of one;
the same model exports to the same graph, so whichever copy lands last is as good as the first.
"""
import asyncio
import os
import subprocess
import sys
import weakref

from trainyard.app.errors import Conflict, TrainyardError
from trainyard.app.launcher import ROOT
from trainyard.app.layout import ARTIFACT_FILES, EXPORT_FILES
from trainyard.app.records import Job
from trainyard.app.settings import Settings

# A large torchvision model takes a minute or so to export to ONNX on a busy CPU.
EXPORT_TIMEOUT_S = 300
# Each export is a process that imports torch (most of a GiB of memory): a burst of first requests
# for many jobs waits its turn rather than crowding the API host out of memory.
MAX_CONCURRENT_EXPORTS = 2
# worker/export.py's exit status for weights saved without what rebuilds the model.
NOT_REBUILDABLE = 3
_locks: "weakref.WeakValueDictionary[str, asyncio.Lock]" = weakref.WeakValueDictionary()
_running = asyncio.Semaphore(MAX_CONCURRENT_EXPORTS)


class ExportFailed(TrainyardError, status=500):
    """The model could not be exported."""


async def exported(settings: Settings, job: Job, fmt: str) -> str:
    """The store key of job's model in fmt (a key of EXPORT_FILES), exported first if it is not there yet.
    FileNotFoundError if the job's artifact is missing; Conflict if it cannot be rebuilt; ExportFailed."""
    key = f"{job.artifact_path}/{EXPORT_FILES[fmt]}"
    lock = _locks.setdefault(key, asyncio.Lock())
    async with lock:
        if not await asyncio.to_thread(_stored, settings.store, key):
            await _export(settings, job, fmt, key)
    return key


def _stored(store, key: str) -> bool:
    try:
        store.size(key)
        return True
    except FileNotFoundError:
        return False


async def _export(settings: Settings, job: Job, fmt: str, key: str) -> None:
    store = settings.store

    def fetch_artifact():
        for name in (ARTIFACT_FILES["meta"], ARTIFACT_FILES["safetensors"]):
            store.fetch(f"{job.artifact_path}/{name}")  # from the bucket, when the store is one
    await asyncio.to_thread(fetch_artifact)
    out = settings.layout.resolve(key)
    async with _running:
        returncode, err = await _run_export(str(out.parent), fmt, str(out), job.id)
    lines = err.decode("utf-8", "replace").strip().splitlines()
    reason = lines[-1] if lines else f"the export process exited with status {returncode}"
    if returncode == NOT_REBUILDABLE:
        raise Conflict(f"job {job.id} cannot be exported: {reason}")
    if returncode != 0:
        raise ExportFailed(f"exporting job {job.id} to {fmt} failed: {reason}")
    await asyncio.to_thread(store.publish, out)


async def _run_export(artifact_dir: str, fmt: str, out: str, job_id: int) -> tuple[int, bytes]:
    """worker/export.py's exit status and stderr."""
    # CUDA hidden: an export needs no GPU, and must not take memory on one the workers train on.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trainyard.worker.export", artifact_dir, fmt, out,
        cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), EXPORT_TIMEOUT_S)
    except TimeoutError:
        raise ExportFailed(f"exporting job {job_id} to {fmt} took longer than {EXPORT_TIMEOUT_S} s") from None
    finally:
        if proc.returncode is None:  # timed out, or the request was cancelled
            proc.kill()
            await proc.wait()
    return proc.returncode, err
