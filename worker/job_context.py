"""JobContext: what a running job gets from its runner: its device, its paths, and a channel to report through.

The training and inference code only sees this object, never the database or the supervisor,
so it can be run and tested in-process on the CPU. A `run` job's own program gets the public
trainyard.Context (worker/public_context.py), which wraps this one.
"""
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainyard.app.core.storage import Store
from trainyard.worker import artifacts
from trainyard.worker.distributed import World


@dataclass
class JobContext:
    job_id: int
    device: torch.device
    data_dir: Path
    # Where this attempt writes its artifact (model.safetensors, model.pt, meta.json); created by the runner.
    artifact_dir: Path
    # Stem of this attempt's checkpoint files; resume_path is the checkpoint to resume from, if any.
    checkpoint_path: Path
    resume_path: Path | None = None
    # Sends one event to the supervisor, e.g. {"type": "epoch", ...}; see worker/runner.py.
    emit: Callable[[dict[str, Any]], None] = lambda event: None
    # True once the worker is shutting down: checkpoint at the next step boundary, then raise Preempted.
    stop_requested: Callable[[], bool] = lambda: False
    # This process's rank among a multi-device job's processes (rank 0 alone reports, checkpoints, saves).
    world: World = field(default_factory=World)
    # Where checkpoints and the artifact are published for other hosts (app/core/storage.py); None: nowhere else.
    store: Store | None = None
    # train: the artifact of the job named by init_from (worker/starting.py loads it).
    init_dir: Path | None = None
    # train: where the weights came from, set by worker/starting.py for the job's result; None: a fresh init.
    started_from: dict[str, Any] | None = None
    _restarted: bool = field(default=False, repr=False)

    def checkpoint_file(self, epoch: int, step: int) -> Path:
        """Each checkpoint gets a file of its own, never overwritten: a stale copy of the job (one
        whose worker lost its lease) may go on writing, but only files the database points at are
        ever resumed from."""
        p = self.checkpoint_path
        return p.with_name(f"{p.stem}-e{epoch:05d}-s{step:06d}{p.suffix}")

    def save_checkpoint(self, epoch: int, step: int, state: dict[str, Any]) -> None:
        """Write a checkpoint (atomically, to a file of its own), publish it to the store, then report it:
        the database points only at checkpoints every host can read."""
        path = self.checkpoint_file(epoch, step)
        artifacts.save_checkpoint(path, state)
        if self.store is not None:
            self.store.publish(path)
        self.emit({"type": "checkpoint", "epoch": epoch, "step": step, "path": str(path)})

    def log(self, line: str) -> None:
        self.emit({"type": "log", "line": line})

    def resume_point(self, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
        """The checkpoint this run resumes from, None if there is none. One the database points at that
        cannot be read (a lost disk, a host that never had it, a torn file) means starting over: the
        supervisor is told once (a `restart` event) and drops the earlier runs' metrics."""
        if self.resume_path is None:
            return None
        try:
            return artifacts.load_checkpoint(self.resume_path, map_location)
        except Exception as exc:
            if not self._restarted:
                self._restarted = True
                why = "it does not exist" if isinstance(exc, FileNotFoundError) else \
                    f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                self.emit({"type": "restart", "path": str(self.resume_path), "reason": why})
            return None
