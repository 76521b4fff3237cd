"""What a training run reports (rank 0 alone): its opening log line, each epoch's metrics (validated on
the epochs `eval_every` asks for) as an event and, every tenth of the run, a log line; an early stop;
and at the end the artifact (the kept epoch's weights) and the job's result."""
import time
from typing import Any

import torch
from torch import nn

from trainyard.app.spec import TrainJob
from trainyard.worker import artifacts, infer, torch_devices
from trainyard.worker.job_context import JobContext
from trainyard.worker.train_checkpoint import Start
from trainyard.worker.train_setup import Run


class Report:
    """The epochs' metrics as they come: rates for the result's mean samples/s, the latest epoch's."""

    def __init__(self, run: Run, ctx: JobContext, epochs: int, at: Start):
        self.run, self.ctx, self.epochs, self.at = run, ctx, epochs, at
        self.log_every = max(1, epochs // 10)
        self.rates: list[float] = []
        self.last: dict[str, Any] | None = None
        self.stopped_at: int | None = None

    def opening(self, spec: TrainJob) -> None:
        run, ctx = self.run, self.ctx
        on = f"{run.world.size} devices ({ctx.device} and the others)" if run.world.size > 1 else str(ctx.device)
        ctx.log(f"training {spec.model.arch} ({run.parameters:,} parameters) on {spec.data.dataset}: "
                f"{len(run.data.y_train)} train / {len(run.data.y_val)} val samples, {run.steps_per_epoch} steps "
                f"per epoch, {on}, {run.precision}")

    def epoch(self, epoch: int, train_loss: float, seen: int, train_seconds: float, started: float) -> bool:
        """Report a trained epoch (0-based here, 1-based in events and logs), validating it when due;
        True when early stopping says stop."""
        run, p, n = self.run, self.run.params, epoch + 1
        final = n == self.epochs
        self.rates.append(seen / train_seconds if train_seconds > 0 else 0.0)
        last = {"epoch": n, "epochs": self.epochs, "train_loss": train_loss, "samples_per_s": self.rates[-1],
                "lr": run.lr, "effective_batch": run.effective_batch, **run.take_grad_norm()}
        stop = False
        if n % p.eval_every == 0 or final:
            last["val_loss"], last["val_accuracy"] = evaluate(run)
            stop = run.watch.update(n, last, run.model)
        last["seconds"] = time.perf_counter() - started
        self.last = last
        self.ctx.emit({"type": "epoch", **last, **(torch_devices.memory_stats(self.ctx.device) or {})})
        if epoch == self.at.epoch or n % self.log_every == 0 or final or stop:
            self.ctx.log(epoch_line(last, self.epochs))
        return stop

    def stopped(self, epochs_done: int) -> None:
        """Early stopping ended the run after epochs_done epochs."""
        self.stopped_at = epochs_done
        if self.run.world.leader:
            self.ctx.log(f"early stopping at epoch {epochs_done}: {self.run.watch.why()}")
            self.ctx.emit({"type": "total", "epochs": epochs_done})


def epoch_line(m: dict[str, Any], epochs: int) -> str:
    val = f" val_loss {m['val_loss']:.4f} val_acc {m['val_accuracy']:.4f}" if "val_loss" in m else ""
    return (f"epoch {m['epoch']}/{epochs} loss {m['train_loss']:.4f}{val} lr {m['lr']:.3g} "
            f"({m['samples_per_s']:,.0f} samples/s)")


def evaluate(run: Run, module: nn.Module | None = None) -> tuple[float, float]:
    """(loss, accuracy) on the validation split, through the same evaluation a predict job uses.

    Its batches start at EVAL_MIN_BATCH (fewer, larger launches) and halve on a GPU out-of-memory down
    to the training batch_size, so they stay within the job's memory budget; out of memory even there,
    the job fails `oom` saying what to change."""
    d = run.data
    # Not through DDP: only rank 0 evaluates, and DDP's forward would wait for the other ranks.
    module = module or (run.model if run.world.size > 1 else run.forward)
    smallest = run.params.batch_size
    try:
        loss, accuracy, _ = infer.evaluate(module, d.x_val, d.y_val, max(smallest, infer.EVAL_MIN_BATCH),
                                           run.device, run.autocast, min_batch=smallest)
    except torch.OutOfMemoryError as e:
        raise torch_devices.EvaluationOutOfMemory(
            torch_devices.oom_message(run.device, smallest, evaluating=True)) from e
    return loss, accuracy


def summary(spec: TrainJob, report: Report) -> dict[str, Any]:
    """Write the artifact (the kept epoch's weights) and return the job's result."""
    run, ctx, at, last = report.run, report.ctx, report.at, report.last
    best, best_state = run.watch.best, run.watch.best_state
    if best is not None and best_state is not None:
        artifacts.load_weights(run.model, best_state)
        last = best["metrics"]
        ctx.log(f"keeping epoch {best['epoch']}: the best {run.watch.keep_metric} ({best['value']:.4f})")
    elif last is None:  # nothing left to run (a checkpoint of a finished run): report the model as it is
        val_loss, val_accuracy = evaluate(run, run.model)
        last = {"train_loss": None, "val_loss": val_loss, "val_accuracy": val_accuracy}
    d = run.data
    meta = {"spec": spec.model_dump(mode="json"), "model": spec.model.model_dump(mode="json"),
            "input_shape": list(d.input_shape), "num_classes": run.num_outputs, "dataset": spec.data.dataset,
            "pixels": d.pixels, "class_names": d.class_names, "precision": run.precision}
    artifacts.save_artifact(ctx.artifact_dir, run.model, meta)
    memory = torch_devices.memory_stats(ctx.device) or {}
    return {
        "epochs": spec.train.epochs,
        "train_loss": last["train_loss"], "val_loss": last["val_loss"], "val_accuracy": last["val_accuracy"],
        "samples_per_s": sum(report.rates) / len(report.rates) if report.rates else None,
        "input_shape": list(d.input_shape), "num_classes": run.num_outputs, "class_names": d.class_names,
        "parameters": run.parameters, "devices": run.world.size,
        "peak_memory_allocated": memory.get("max_memory_allocated"),
        "peak_memory_reserved": memory.get("max_memory_reserved"),
        "applied": run.applied,
        "resumed_from_epoch": at.epoch if at.resumed else None,
        "resumed_from_step": at.step if at.resumed else None,
        "kept": spec.train.keep, "kept_epoch": best["epoch"] if best else report.stopped_at or spec.train.epochs,
        "stopped_early_at": report.stopped_at,
        "started_from": ctx.started_from,
    }
