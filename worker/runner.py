"""The job process: runs one job on its device and reports events to the supervisor through a pipe.

It is started from a fork server that has already imported torch (and this module) but has never
initialised CUDA, so a job starts in milliseconds and each job gets a clean CUDA context; a crash,
a leak or an out-of-memory here cannot take the worker down. This process never touches the
database: it only sends events (see EVENTS) and the supervisor writes them, fenced by its claim.
"""
import os
import signal
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import torch

from app.spec import parse_spec
from worker import devices, infer, train
from worker.context import JobContext, Preempted

# Events sent to the supervisor:
#   {"type": "epoch", "epoch": n, ...metrics}      one per finished epoch
#   {"type": "checkpoint", "epoch": n, "step": s, "path": str}
#   {"type": "log", "line": str}
#   {"type": "done", "result": {...}}              the job succeeded (artifact in ctx.artifact_dir)
#   {"type": "error", "error": {"class", "type", "message", "traceback"}}
#   {"type": "preempted"}                          checkpointed after a stop request
EVENTS = ("epoch", "checkpoint", "log", "done", "error", "preempted")

_stop = False


def _on_sigterm(signum, frame) -> None:
    # Only set a flag: the training loop checkpoints at the next step boundary and raises Preempted.
    global _stop
    _stop = True


def run(job: dict[str, Any], device: str, data_dir: str, paths: dict[str, Any], conn: Connection) -> None:
    """Entry point of the job process. `paths` holds artifact_dir, checkpoint_path, resume_path, model_dir."""
    # Ctrl-C in a terminal reaches the whole process group; the supervisor decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        execute(job, device, data_dir, paths, conn.send)
    finally:
        conn.close()
        # Skip interpreter teardown (atexit hooks, CUDA context destruction order): the supervisor
        # already has everything it needs, and the OS frees the device memory with the process.
        os._exit(0)


def execute(job: dict[str, Any], device: str, data_dir: str, paths: dict[str, Any],
            emit: Callable[[dict], None]) -> None:
    """Run the job, ending with exactly one of the events done, error or preempted."""
    torch_device = None
    batch_size = None
    try:
        spec = parse_spec(job["spec"])
        batch_size = spec.train.batch_size if spec.kind == "train" else spec.batch_size
        torch_device = devices.resolve(device)
        if paths.get("threads"):
            torch.set_num_threads(paths["threads"])
        ctx = JobContext(
            job_id=job["id"], device=torch_device, data_dir=Path(data_dir),
            artifact_dir=Path(paths["artifact_dir"]), checkpoint_path=Path(paths["checkpoint_path"]),
            resume_path=Path(paths["resume_path"]) if paths.get("resume_path") else None,
            emit=emit, stop_requested=lambda: _stop)
        if spec.kind == "train":
            result = train.train(spec, ctx)
        else:
            train_spec = parse_spec(paths["model_spec"]) if paths.get("model_spec") else None
            result = infer.predict(spec, ctx, Path(paths["model_dir"]), train_spec)
        emit({"type": "done", "result": result})
    except Preempted:
        emit({"type": "preempted"})
    except torch.OutOfMemoryError as exc:
        emit({"type": "error", "error": _error("oom", exc, devices.oom_message(torch_device, batch_size))})
    except Exception as exc:  # JobError, or an exception in training: the job's own error, not retried
        emit({"type": "error", "error": _error("job", exc)})


def _error(cls: str, exc: BaseException, message: str | None = None) -> dict:
    return {"class": cls, "type": type(exc).__name__, "message": message or str(exc) or type(exc).__name__,
            "traceback": traceback.format_exc(limit=20)}
