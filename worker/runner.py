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

On their way, rank 0's events write the job's TensorBoard event files (worker/event_files.py).
"""
import io
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from trainyard.app.core import storage
from trainyard.app.core.errors import Unavailable
from trainyard.app.core.layout import Layout
from trainyard.app.core.states import DEVICE_FAILURE, ErrorRecord, Failure, error_record
from trainyard.app.spec import PredictJob, RunJob, TrainJob, parse_spec
from trainyard.worker import broken_links, distributed, entrypoints, event_files, infer, torch_devices, train
from trainyard.worker.errors import JobError, Preempted, RendezvousFailed
from trainyard.worker.job_context import JobContext
from trainyard.worker.supervisor import memory, reaper
from trainyard.worker.supervisor.plan import JobPlan

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


@dataclass
class _Placement:
    """How far the job got towards its device: what an error it raises is reported with."""
    name: str                                 # its device's name (its rank's, on several devices)
    device: torch.device | None = None
    batch_size: int | None = None
    world: distributed.World = field(default_factory=distributed.World)


def execute(plan: JobPlan, emit: Callable[[dict], None], own_process: bool = False) -> None:
    """Run the job, ending with exactly one of the events done, error or preempted. In its own
    process (own_process) it first sets the process-wide limits (threads, memory) and, for a job on
    several devices, forks its other ranks (worker/distributed.py)."""
    where = _Placement(plan.device)
    try:
        spec = parse_spec(plan.job.spec)
        store = storage.open_store(plan.storage_url, Layout(plan.data_dir))
        _fetch(store, plan.fetch)
        where.batch_size = spec.train.batch_size if spec.kind == "train" else getattr(spec, "batch_size", None)
        # Before anything initialises CUDA (every rank inherits it through the fork below).
        torch_devices.prepare_deterministic(spec.kind == "train" and spec.train.deterministic)
        if len(plan.ranks) > 1:
            if not own_process:
                raise RuntimeError("a job on several devices forks its ranks: run it in a process of its own")
            where.world, emit = distributed.fork_ranks(len(plan.ranks), emit, plan.local_ranks)
        emit = event_files.through(emit, spec, plan, store, where.world.rank)  # rank 0's TensorBoard event files
        device = _take_device(plan, where, own_process)
        # A run job's data_dir is a directory of its own, not the service's (where the database is).
        data_dir = plan.scratch_dir if spec.kind == "run" and plan.scratch_dir else plan.data_dir
        ctx = JobContext(job_id=plan.job.id, device=device, data_dir=data_dir, artifact_dir=plan.run_dir,
                         checkpoint_path=plan.checkpoint_stem, resume_path=plan.resume_from, emit=emit,
                         stop_requested=lambda: _stop, world=where.world, store=store,
                         init_dir=plan.model_dir if spec.kind == "train" else None)
        result = _run_kind(spec, ctx, plan)
        if where.world.rank == 0:  # the run's model or result, for every host to read (a bucket store)
            store.publish_dir(plan.run_dir)
        emit({"type": "done", "result": result})
    except Exception as exc:
        ending = _ending(exc, plan, where)
        if plan.master and ending.get("error", {}).get("type") == "RankLost":
            # Another host's ranks broke the collective: their worker records why, if they can, meanwhile.
            time.sleep(distributed.REASON_WAIT_S)
        emit(ending)


def _take_device(plan: JobPlan, where: _Placement, own_process: bool) -> torch.device:
    """This rank's device, made the current one, with the process's limits set and the ranks joined."""
    rank = where.world.rank
    where.name = plan.ranks[rank] if plan.ranks else plan.device
    if plan.master:
        distributed.use_interface(plan.node_addr)
    if plan.rank_uuids:  # before anything touches CUDA: this rank sees its own GPU, by its UUID
        where.name = distributed.pin(where.name, plan.rank_uuids[rank])
    device = where.device = torch_devices.resolve(where.name)
    # First thing on the device: the job's card becomes the current one, so nothing of this job
    # (bf16's check, a run job's .cuda(), a library's default) lands on GPU 0, another job's card.
    torch_devices.use_device(device)
    if own_process:
        _limit(plan, device)
    distributed.init(where.world, device, plan.checkpoint_stem.with_name(plan.checkpoint_stem.name + ".ranks"),
                     plan.master)
    return device


def _run_kind(spec: TrainJob | PredictJob | RunJob, ctx: JobContext, plan: JobPlan) -> dict[str, Any]:
    """The job itself: train, the run job's entrypoint, or predict; its result."""
    if spec.kind == "train":
        return train.train(spec, ctx)
    if spec.kind == "run":
        return entrypoints.run(spec, ctx, plan.job.attempt)
    model_spec = parse_spec(plan.model_spec) if plan.model_spec else None
    if plan.model_dir is None:  # the supervisor plans a predict job with its model job's artifact
        raise JobError("a predict job needs its model's artifact")
    return infer.predict(spec, ctx, plan.model_dir, model_spec if isinstance(model_spec, TrainJob) else None)


def _ending(exc: Exception, plan: JobPlan, where: _Placement) -> dict:
    """The event that ends a job whose run raised exc: preempted, or an error of the class it deserves."""
    if isinstance(exc, Preempted):
        return {"type": "preempted"}
    if isinstance(exc, torch_devices.EvaluationOutOfMemory):  # its message already says what to change
        return {"type": "error", "error": _error(Failure.OOM, exc)}
    if isinstance(exc, torch.OutOfMemoryError):
        message = torch_devices.oom_message(where.device, where.batch_size) \
            if where.device is not None and where.batch_size is not None else None
        return {"type": "error", "error": _error(Failure.OOM, exc, message)}
    if isinstance(exc, Unavailable | RendezvousFailed):  # the store or the ranks' network: retried
        return {"type": "error", "error": _error(Failure.INFRASTRUCTURE, exc)}
    if where.world.size > 1 and broken_links.is_broken_link(exc):  # the run's, on one host as across hosts
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        gone = "a host's ranks or its network" if plan.master else "another rank's process or its link"
        message = (f"rank {where.world.rank} lost its link to the job's other ranks ({gone} went away): "
                   f"{type(exc).__name__}: {first}")
        error = _error(Failure.INFRASTRUCTURE, exc, message)
        return {"type": "error", "error": {**error, "type": "RankLost", "rank": where.world.rank}}
    # JobError, or an exception in training: the job's own error, not retried
    if torch_devices.is_device_failure(exc):  # the device's, not the job's: retried on another worker
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        error = _error(Failure.INFRASTRUCTURE, exc, f"device {where.name} failed: {type(exc).__name__}: {first}")
        return {"type": "error", "error": {**error, "type": DEVICE_FAILURE, "rank": where.world.rank}}
    if memory.is_allocation_failure(exc):
        asked = f" ({str(exc).splitlines()[0][:200]})" if str(exc) else ""
        message = memory.budget_message(plan.memory_budget, None, asked) if plan.memory_budget \
            else f"out of host memory{asked}"
        return {"type": "error", "error": _error(Failure.OOM, exc, message)}
    return {"type": "error", "error": _error(Failure.JOB, exc)}


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
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)


def _limit(plan: JobPlan, device: torch.device) -> None:
    if plan.threads:
        torch.set_num_threads(plan.threads)
    # Not on CUDA jobs: the driver maps large host regions of its own (the supervisor watches those).
    if plan.memory_budget and device.type == "cpu":
        memory.limit_data_segment(plan.memory_budget)
    torch_devices.limit_memory_fraction(device, plan.gpu_memory_fraction)


def _error(cls: Failure, exc: BaseException, message: str | None = None) -> ErrorRecord:
    return error_record(cls, type(exc).__name__, message or str(exc) or type(exc).__name__,
                        traceback.format_exc(limit=20))
