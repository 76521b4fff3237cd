"""A train or run job's TensorBoard event files, written by its rank 0 from the events it sends (runner.py wraps
its emit): each epoch's metrics as scalars at step = epoch (a train job's learning rate among them, a run job's
ctx.report as it gives them), the job's hyperparameters through the HParams plugin (a train job's model, data and
train fields flattened; a run job's entrypoint and config), and at its end the final metrics as final/<name>
scalars (a train job's kept epoch's), so that a sweep's trials compare side by side in the HParams dashboard.

Where: tensorboard/<job>/ of the data directory (app/core/layout.py), so that `tensorboard --logdir
<data_dir>/tensorboard` shows every job as a run named by its id. On a bucket store a run's file is published at
each checkpoint and at the run's end (a file that grows is published again: only its own run writes it), so what
a run resumed on another host builds on is in the bucket.

Each run of a job (each claim) writes a file of its own (named .run-<claim>), opened at the first epoch it
reports with purge_step at that epoch: TensorBoard's readers then drop what earlier runs wrote from that step on
(the epochs a crash lost, run again after the checkpoint; or all of them, for a run that starts over), so each
epoch shows once.

Only the HParams plugin's session start and end are written, not its experiment summary: without one, TensorBoard
builds the dashboard's columns from every run's hyperparameters and scalars, where one run's summary would stand
for all (the first found).

Writing is a side matter: an error is said once in the job's log, and the job goes on without event files.
"""
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.app.core.storage import Store
from trainyard.app.spec import PredictJob, RunJob, TrainJob
from trainyard.worker.supervisor.plan import JobPlan

try:  # the worker extra installs tensorboard; a worker without it writes no event files (and says so)
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams
except ImportError:  # pragma: no cover - tensorboard is in the worker and test extras
    SummaryWriter = None  # type: ignore[assignment,misc]  # checked before each use

Emit = Callable[[dict[str, Any]], None]
# What an epoch event carries that is no metric.
NOT_METRICS = {"type", "epoch", "epochs"}
# A train job's final metrics: its result's, those of the kept epoch.
TRAIN_FINAL = ("train_loss", "val_loss", "val_accuracy")
FINAL = "final/"
# How often the writer's thread writes what it holds to the file, for a `tensorboard` watching a run live.
FLUSH_S = 5
# Bounds on what one job's hyperparameters put in the HParams table (a run job's config may be large).
MAX_HPARAMS, MAX_HPARAM_TEXT, MAX_FINAL = 200, 500, 100


def through(emit: Emit, spec: TrainJob | PredictJob | RunJob, plan: JobPlan, store: Store, rank: int) -> Emit:
    """emit, writing the job's event files on the way where this process writes them (rank 0 of a train or run
    job); emit itself otherwise."""
    if rank != 0 or isinstance(spec, PredictJob):
        return emit
    return EventFiles(store.layout.tensorboard(plan.job.id), store, hyperparameters(spec), emit, spec.kind,
                      plan.job.claim or 0)


class EventFiles:
    """The emit of a job process that writes its run's event file from the events it passes on."""

    def __init__(self, folder: Path, store: Store | None, hparam_values: dict[str, Any], emit: Emit, kind: str,
                 claim: int):
        self.folder, self.store, self.hparams, self.emit, self.kind = folder, store, hparam_values, emit, kind
        self.suffix = f".run-{claim}"
        self.writer: Any = None
        self.broken = False
        self.last: dict[str, float] = {}
        self.last_epoch = 0

    def __call__(self, event: dict[str, Any]) -> None:
        # Before the event goes on: a job's files are in the store by the time its end is recorded.
        if not self.broken:
            try:
                self._see(event)
            except Exception as exc:  # never the job's failure
                self._fail(exc)
        self.emit(event)

    def _see(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "epoch":
            self._epoch(event)
        elif kind == "checkpoint" and self.writer is not None:  # a resumed run starts from here: publish
            self.writer.flush()
            self._publish()
        elif kind == "done":
            self._end(event.get("result") or {})
        elif kind in ("error", "preempted"):
            self._close()

    def _open(self, purge_step: int | None) -> None:
        if SummaryWriter is None:
            raise RuntimeError("tensorboard is not installed on this worker (pip install 'trainyard[worker]')")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.folder), purge_step=purge_step, filename_suffix=self.suffix,
                                    flush_secs=FLUSH_S)
        _, start, _ = hparams(self.hparams, {})
        self.writer.file_writer.add_summary(start)

    def _epoch(self, event: dict[str, Any]) -> None:
        epoch = int(event["epoch"])
        if self.writer is None:
            self._open(purge_step=epoch)
        metrics = {k: float(v) for k, v in event.items() if k not in NOT_METRICS and _number(v)}
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, epoch)
        self.last, self.last_epoch = metrics, epoch
        # Not flushed here: the writer's thread does every FLUSH_S (for a live `tensorboard`), and a checkpoint
        # flushes (above), which is all a SIGKILL can need: what came after the last checkpoint is run again and
        # written again by the resumed run, whose purge_step drops this run's copy. Half an epoch's cost of events.

    def _end(self, result: dict[str, Any]) -> None:
        if self.writer is None:  # nothing left to run (resumed at its end): the final metrics still go in
            self._open(purge_step=None)
        for name, value in final_metrics(self.kind, result, self.last).items():
            self.writer.add_scalar(FINAL + name, value, self.last_epoch)
        _, _, end = hparams({}, {})
        self.writer.file_writer.add_summary(end)
        self._close()

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self._publish()
            self.writer = None

    def _publish(self) -> None:
        if self.store is not None:
            for path in sorted(self.folder.glob(f"*tfevents*{self.suffix}")):
                self.store.publish(path)

    def _fail(self, exc: Exception) -> None:
        self.broken = True
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        self.emit({"type": "log", "line": f"tensorboard: no more event files for this run "
                                          f"({type(exc).__name__}: {first}); the job goes on"})
        try:
            if self.writer is not None:
                self.writer.close()
        except Exception:  # already said: the writer is given up either way
            pass
        self.writer = None


def hyperparameters(spec: TrainJob | RunJob) -> dict[str, Any]:
    """The job's hyperparameters, flattened to dotted names: a train job's model, data and train fields, a run
    job's entrypoint and config. Lists are JSON text, booleans "true"/"false", None left out."""
    if isinstance(spec, TrainJob):
        tree: dict[str, Any] = {"model": spec.model.model_dump(mode="json"), "data": spec.data.model_dump(mode="json"),
                                "train": spec.train.model_dump(mode="json"), "devices": spec.devices}
    else:
        tree = {"entrypoint": spec.entrypoint, "config": spec.config}
    flat: dict[str, Any] = {}
    _flatten(tree, "", flat)
    return dict(list(flat.items())[:MAX_HPARAMS])


def _flatten(value: Any, name: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(inner, f"{name}.{key}" if name else str(key), out)
    elif isinstance(value, bool):
        out[name] = str(value).lower()
    elif _number(value):
        out[name] = value
    elif isinstance(value, str):
        out[name] = value[:MAX_HPARAM_TEXT]
    elif value is not None:
        out[name] = json.dumps(value)[:MAX_HPARAM_TEXT]


def final_metrics(kind: str, result: dict[str, Any], last: dict[str, float]) -> dict[str, float]:
    """The job's final metrics: a train job's result's (its kept epoch's); a run job's returned numbers, or its last
    report's when it returned none."""
    got: dict[str, Any] = {k: result.get(k) for k in TRAIN_FINAL} if kind == "train" else \
        {k: v for k, v in result.items() if _number(v)} or dict(last)
    return {k: float(v) for k, v in list(got.items())[:MAX_FINAL] if _number(v)}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
