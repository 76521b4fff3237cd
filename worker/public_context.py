"""trainyard.Context: what your own training program gets when trainyard runs it as a `run` job.

    def main(ctx: trainyard.Context, config: dict) -> dict | None:
        state = ctx.restore()                      # the last checkpoint, after a crash or a preemption
        start = state["epoch"] if state else 0
        for epoch in range(start + 1, config["epochs"] + 1):
            ...                                    # train on ctx.device
            ctx.report(epoch, loss=loss)           # metrics, SSE, dashboard curves, CLI progress
            ctx.checkpoint({"epoch": epoch, "model": model.state_dict(), ...})
            if ctx.should_stop():                  # shutdown, cancel or timeout
                return None
        ctx.save_model(model, arch="mynet", input_shape=[3, 32, 32], class_names=classes)
        return {"accuracy": acc}

With `"devices": N` the program runs once per device, in N processes of one host with torch.distributed
set up (ctx.rank, ctx.world_size): wrap the model with ctx.parallel(model), train each rank on its own
shard of the data, and call should_stop() at the same points on every rank (the ranks vote: a stop
reaches rank 0 first). Only rank 0's reports, checkpoints and model are kept; the other ranks that call
checkpoint() or save_model() return once rank 0's is written (worker/leader_wait.py).

The same program runs outside trainyard with Context.local(), which keeps everything in memory
and a temporary directory: handy for a first try, and what bench/run_overhead.py measures against.
"""
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainyard.app.spec import MAX_META_FILE_BYTES, MAX_METRIC_KEYS, MAX_METRIC_NAME, MAX_MODEL_META_BYTES, ModelSpec
from trainyard.worker import artifacts, distributed, nets, torch_devices
from trainyard.worker.errors import JobError
from trainyard.worker.job_context import JobContext
from trainyard.worker.leader_wait import leader_alone

# Types a checkpoint may hold: restore() loads it with torch.load(weights_only=True), nothing unpickled.
_PLAIN = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.Size, torch.dtype, torch.device)


class Context:
    directory: Path      # Context.local(): the temporary directory it keeps everything in
    events: list[dict]   # Context.local(): every event the job sent

    def __init__(self, job: JobContext, config: dict[str, Any], attempt: int = 1):
        self._job = job
        self.config = config
        self.attempt = attempt
        self._last_epoch = 0
        self._checkpoints = 0
        self._resumed_epoch: int | None = None

    # -- who, where ---------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The job's device, already the process's current one: a bare .cuda() or torch.device("cuda") lands on it."""
        return self._job.device

    @property
    def job_id(self) -> int:
        return self._job.job_id

    @property
    def data_dir(self) -> Path:
        """A directory of this run's own, empty at its start and removed at its end (a scratch space: keep
        what must last with checkpoint() or save_model())."""
        return self._job.data_dir

    @property
    def rank(self) -> int:
        return self._job.world.rank

    @property
    def world_size(self) -> int:
        return self._job.world.size

    @property
    def local_rank(self) -> int:
        """This rank's place among the ranks on its own host (rank itself for a job on one host)."""
        return self._job.world.local_rank

    def parallel(self, model: nn.Module) -> nn.Module:
        """The model as it should be trained: in DistributedDataParallel on several devices, as is on one."""
        if self.world_size == 1:
            return model
        ids = [self.device] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    # -- progress -----------------------------------------------------------------------------

    def report(self, epoch: int, **metrics: float) -> None:
        """One record of numbers per epoch (epochs count from 1): at most 100 metrics, each name at most 100
        characters. On CUDA the allocator's memory is added."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"report: epoch must be a whole number from 1, not {epoch!r}")
        if len(metrics) > MAX_METRIC_KEYS:
            raise ValueError(f"report: {len(metrics)} metrics is over the limit of {MAX_METRIC_KEYS} per report")
        for key in metrics:
            if len(key) > MAX_METRIC_NAME:
                raise ValueError(f"report: metric name {key[:40]!r}... is {len(key)} characters; the limit is "
                                 f"{MAX_METRIC_NAME}")
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"report: metric {key!r} must be a finite number, not {value!r}")
        self._last_epoch = epoch
        self._job.emit({"type": "epoch", "epoch": epoch, **metrics, **(torch_devices.memory_stats(self.device) or {})})

    def set_total(self, epochs: int) -> None:
        """How many epochs to expect: the denominator of the job's progress."""
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"set_total: epochs must be a whole number from 1, not {epochs!r}")
        self._job.emit({"type": "total", "epochs": epochs})

    def log(self, message: str) -> None:
        self._job.log(str(message))

    def should_stop(self) -> bool:
        """True once the job must stop: its worker is shutting down, it was cancelled or ran out of time.
        Checkpoint and return: the job is requeued (shutdown) or ends as cancelled or timed out.
        On several devices every rank must call it at the same points: the ranks agree."""
        return distributed.any_true(self._job.stop_requested(), self._job.world)

    # -- checkpoints --------------------------------------------------------------------------

    def checkpoint(self, state: dict[str, Any]) -> None:
        """Save state (tensors and plain data: numbers, strings, lists, dicts) atomically. A resumed run
        gets the latest back from restore(); epochs reported after it are run and reported again."""
        _check_plain(state, "state")
        # Rank 0's is the job's; the other ranks wait for it by the store (not in the next collective, which
        # would time out behind a slow upload) when they call this too.
        with leader_alone(self._job.world, "checkpoint"):
            if self.rank == 0:
                self._checkpoints += 1
                self._job.save_checkpoint(self._last_epoch, self._checkpoints, state)

    def restore(self) -> dict[str, Any] | None:
        """The latest checkpoint of an earlier run of this job, loaded onto ctx.device; None if there is none."""
        return self._job.resume_point(self.device)

    # -- the artifact -------------------------------------------------------------------------

    def save_model(self, model: nn.Module | dict[str, torch.Tensor], **meta: Any) -> None:
        """The job's artifact: the weights (safetensors and torch.save) and meta.json, downloadable like
        a train job's. With arch (built-in or a model plugin, plus its params or fields), input_shape and
        class_names (or num_classes), predict jobs rebuild it; name `dataset` (a built-in's scaling) or
        `pixels` (0..255 images) for raw inputs to be scaled like its training data."""
        with leader_alone(self._job.world, "save_model"):  # as checkpoint(): the other ranks wait by the store
            if self.rank == 0:
                self._save_model(model, meta)

    def _save_model(self, model: nn.Module | dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        extra = {k: v for k, v in meta.items() if k not in _MODEL_KEYS}
        try:
            size = len(json.dumps(extra))
        except (TypeError, ValueError) as e:
            raise ValueError(f"save_model: meta must be JSON: {e}") from None
        if size > MAX_MODEL_META_BYTES:
            raise ValueError(f"save_model: the extra meta is {size:,} bytes of JSON; the limit is "
                             f"{MAX_MODEL_META_BYTES // 1024} KiB (keep large things in files of your own)")
        info = {"meta": extra, "precision": "fp32"}
        if "arch" in meta:
            info.update(self._rebuildable(model, meta))
        if len(json.dumps(info, indent=2)) >= MAX_META_FILE_BYTES - 1024:  # every predict submit naming it reads it
            raise ValueError(f"save_model: meta.json would be over {MAX_META_FILE_BYTES >> 20} MiB")
        artifacts.save_artifact(self._job.artifact_dir, model, info)

    def _rebuildable(self, model, meta: dict[str, Any]) -> dict[str, Any]:
        """The meta predict jobs rebuild the model from, once it is proven to rebuild these weights."""
        class_names = [str(c) for c in meta.get("class_names") or []]
        num_classes = int(meta.get("num_classes") or len(class_names))
        fields = {k: v for k, v in meta.items() if k in ModelSpec.model_fields and k != "num_classes"}
        spec = ModelSpec.model_validate(fields)
        input_shape = [int(n) for n in meta.get("input_shape") or []]
        if not input_shape or num_classes < 2:
            raise ValueError("save_model: arch needs input_shape and class_names (or num_classes >= 2)")
        state = artifacts.cpu_state_dict(model) if isinstance(model, nn.Module) else model
        try:
            nets.build_model(spec, tuple(input_shape), num_classes).load_state_dict(state)
        except (RuntimeError, JobError) as e:
            raise ValueError(f"save_model: {spec.arch} with input_shape {input_shape} and {num_classes} classes does "
                             f"not take these weights: {str(e).splitlines()[0]}") from None
        return {"model": spec.model_dump(mode="json"), "input_shape": input_shape, "num_classes": num_classes,
                "class_names": class_names, "dataset": meta.get("dataset"), "pixels": meta.get("pixels")}

    # -- outside trainyard --------------------------------------------------------------------

    @classmethod
    def local(cls, config: dict[str, Any] | None = None, device: str = "cpu", data_dir: Path | None = None,
              resume_from: Path | None = None) -> "Context":
        """A Context for running an entrypoint in this process: reports go to `reported` and stdout,
        checkpoints and the artifact to a temporary directory (`directory`)."""
        root = Path(tempfile.mkdtemp(prefix="trainyard-local-"))
        events: list[dict] = []

        def emit(event: dict) -> None:
            events.append(event)
            if event["type"] in ("log", "epoch"):
                print(event.get("line") or {k: v for k, v in event.items() if k != "type"}, file=sys.stderr)

        # As in a job process: the device is the current one, so the program's .cuda() lands on it.
        torch_devices.use_device(torch.device(device))
        job = JobContext(job_id=0, device=torch.device(device), data_dir=data_dir or root / "data",
                         artifact_dir=root / "artifact", checkpoint_path=root / "checkpoints" / "run.pt",
                         resume_path=resume_from, emit=emit)
        ctx = cls(job, config or {})
        ctx.directory, ctx.events = root, events
        return ctx

    @property
    def reported(self) -> list[dict]:
        """Context.local(): every report so far."""
        return [e for e in getattr(self, "events", []) if e["type"] == "epoch"]


_MODEL_KEYS = {"arch", "params", "input_shape", "class_names", "num_classes", "dataset", "pixels",
               *ModelSpec.model_fields}


def _check_plain(value: Any, where: str, depth: int = 0) -> None:
    if depth > 50:
        raise ValueError(f"checkpoint: {where} is nested too deeply")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise ValueError(f"checkpoint: {where} has a key of type {type(k).__name__}")
            _check_plain(v, f"{where}[{k!r}]", depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]", depth + 1)
    elif not isinstance(value, _PLAIN):
        raise ValueError(f"checkpoint: {where} is a {type(value).__name__}; a checkpoint holds tensors and plain "
                         "data (numbers, strings, lists, dicts), so that restoring it unpickles nothing")
