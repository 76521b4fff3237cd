"""The job process: runs one job on its device and reports events to the supervisor through a pipe.

It is started from a fork server that has already imported torch (and this module) but has never
initialised CUDA, so a job starts in milliseconds and each job gets a clean CUDA context; a crash,
a leak or an out-of-memory here cannot take the worker down. This process never touches the
database: it only sends events and the supervisor writes them, fenced by its claim:

    {"type": "epoch", "epoch": n, ...metrics}      one per finished epoch
    {"type": "checkpoint", "epoch": n, "step": s, "path": str}
    {"type": "log", "line": str}
    {"type": "done", "result": {...}}              the job succeeded (artifact or result in the run dir)
    {"type": "error", "error": {"class", "type", "message", "traceback"}}
    {"type": "preempted"}                          checkpointed after a stop request
"""
import os
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from trainyard.app import storage
from trainyard.app.errors import Unavailable
from trainyard.app.layout import Layout
from trainyard.app.spec import parse_spec
from trainyard.app.states import DEVICE_FAILURE, Failure, error_record
from trainyard.worker import distributed, entrypoints, infer, memory, reaper, torch_devices, train
from trainyard.worker.context import JobContext, Preempted
from trainyard.worker.plan import JobPlan

_stop = False


def _on_sigterm(signum, frame) -> None:
    # Only set a flag: the training loop checkpoints at the next step boundary and raises Preempted.
    global _stop
    _stop = True


def run(plan: JobPlan, conn: Connection, output: Connection | None = None) -> None:
    """Entry point of the job process; output: the pipe its stdout and stderr go to (the job's log)."""
    # Ctrl-C in a terminal reaches the whole process group; the supervisor decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    # Whatever the job starts stays below this process, double-forked or not, and ends with it.
    reaper.become_subreaper()
    try:
        _capture_output(output)
        execute(plan, conn.send, own_process=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        conn.close()
        reaper.end_descendants(os.getpid())
        # Skip interpreter teardown (atexit hooks, CUDA context destruction order): the supervisor
        # already has everything it needs, and the OS frees the device memory with the process.
        os._exit(0)


def execute(plan: JobPlan, emit: Callable[[dict], None], own_process: bool = False) -> None:
    """Run the job, ending with exactly one of the events done, error or preempted. In its own
    process (own_process) it first sets the process-wide limits (threads, memory) and, for a job on
    several devices, forks its other ranks (worker/distributed.py)."""
    device, batch_size, world, name = None, None, distributed.World(), plan.device
    try:
        spec = parse_spec(plan.job.spec)
        store = storage.open_store(plan.storage_url, Layout(plan.data_dir))
        _fetch(store, plan.fetch)
        batch_size = spec.train.batch_size if spec.kind == "train" else getattr(spec, "batch_size", None)
        # Before anything initialises CUDA (every rank inherits it through the fork below).
        torch_devices.prepare_deterministic(spec.kind == "train" and spec.train.deterministic)
        if len(plan.ranks) > 1:
            if not own_process:
                raise RuntimeError("a job on several devices forks its ranks: run it in a process of its own")
            world, emit = distributed.fork_ranks(len(plan.ranks), emit)
        name = plan.ranks[world.rank] if plan.ranks else plan.device
        if plan.rank_uuids:  # before anything touches CUDA: this rank sees its own GPU, by its UUID
            name = distributed.pin(name, plan.rank_uuids[world.rank])
        device = torch_devices.resolve(name)
        # First thing on the device: the job's card becomes the current one, so nothing of this job
        # (bf16's check, a run job's .cuda(), a library's default) lands on GPU 0, another job's card.
        torch_devices.use_device(device)
        if own_process:
            _limit(plan, device)
        distributed.init(world, device, plan.checkpoint_stem.with_name(plan.checkpoint_stem.name + ".ranks"))
        # A run job's data_dir is a directory of its own, not the service's (where the database is).
        data_dir = plan.scratch_dir if spec.kind == "run" and plan.scratch_dir else plan.data_dir
        ctx = JobContext(job_id=plan.job.id, device=device, data_dir=data_dir, artifact_dir=plan.run_dir,
                         checkpoint_path=plan.checkpoint_stem, resume_path=plan.resume_from, emit=emit,
                         stop_requested=lambda: _stop, world=world, store=store,
                         init_dir=plan.model_dir if spec.kind == "train" else None)
        if spec.kind == "train":
            result = train.train(spec, ctx)
        elif spec.kind == "run":
            result = entrypoints.run(spec, ctx, plan.job.attempt)
        else:
            train_spec = parse_spec(plan.model_spec) if plan.model_spec else None
            result = infer.predict(spec, ctx, plan.model_dir, train_spec)
        if world.rank == 0:  # the run's model or result, for every host to read (a bucket store)
            store.publish_dir(plan.run_dir)
        emit({"type": "done", "result": result})
    except Preempted:
        emit({"type": "preempted"})
    except torch_devices.EvaluationOutOfMemory as exc:  # its message already says what to change
        emit({"type": "error", "error": _error(Failure.OOM, exc)})
    except torch.OutOfMemoryError as exc:
        emit({"type": "error", "error": _error(Failure.OOM, exc, torch_devices.oom_message(device, batch_size))})
    except Unavailable as exc:  # the object store could not be reached: the host's trouble, retried
        emit({"type": "error", "error": _error(Failure.INFRASTRUCTURE, exc)})
    except Exception as exc:  # JobError, or an exception in training: the job's own error, not retried
        if torch_devices.is_device_failure(exc):  # the device's, not the job's: retried on another worker
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            error = _error(Failure.INFRASTRUCTURE, exc, f"device {name} failed: {type(exc).__name__}: {first}")
            emit({"type": "error", "error": {**error, "type": DEVICE_FAILURE, "rank": world.rank}})
        elif memory.is_allocation_failure(exc):
            asked = f" ({str(exc).splitlines()[0][:200]})" if str(exc) else ""
            message = memory.budget_message(plan.memory_budget, None, asked) if plan.memory_budget \
                else f"out of host memory{asked}"
            emit({"type": "error", "error": _error(Failure.OOM, exc, message)})
        else:
            emit({"type": "error", "error": _error(Failure.JOB, exc)})


def _fetch(store: storage.Store, keys: tuple[str, ...]) -> None:
    """Bring what another host may have written (the checkpoint to resume from, the model to predict
    with, uploads) to this host's disk. A missing one is the job's to notice: a missing checkpoint
    starts it over (JobContext.resume_point), a missing model or upload fails it, naming the file."""
    for key in keys:
        try:
            store.fetch(key)
        except FileNotFoundError:
            pass


def _capture_output(output: Connection | None) -> None:
    """What the job prints, Python's or a library's own (a C extension writing to fd 1), and its children's,
    goes to the supervisor, which appends it to the job's log (GET /jobs/{id}/logs) within its cap."""
    if output is None:
        return
    os.dup2(output.fileno(), 1)
    os.dup2(output.fileno(), 2)
    output.close()
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def _limit(plan: JobPlan, device: torch.device) -> None:
    if plan.threads:
        torch.set_num_threads(plan.threads)
    # Not on CUDA jobs: the driver maps large host regions of its own (the supervisor watches those).
    if plan.memory_budget and device.type == "cpu":
        memory.limit_data_segment(plan.memory_budget)
    torch_devices.limit_memory_fraction(device, plan.gpu_memory_fraction)


def _error(cls: Failure, exc: BaseException, message: str | None = None) -> dict:
    return error_record(cls, type(exc).__name__, message or str(exc) or type(exc).__name__,
                        traceback.format_exc(limit=20))
