"""Predict and evaluate with a trained artifact; also the evaluation pass the training loop reports.

Training's val_accuracy and an evaluate job on the same split go through evaluate() below with
the same model and data, so they agree exactly.
"""
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainyard.app.core.layout import RESULT_FILE
from trainyard.app.spec import PredictJob, TrainJob
from trainyard.worker import artifacts, data, torch_devices
from trainyard.worker.errors import JobError
from trainyard.worker.job_context import JobContext

EVAL_MIN_BATCH = 1024
# A confusion matrix is k x k counts: past this many classes only per-class accuracy is reported.
MAX_CONFUSION_CLASSES = 1000


@torch.no_grad()
def logits_in_batches(model: nn.Module, x: Tensor, batch_size: int, device: torch.device,
                      autocast: Callable[[], AbstractContextManager] = nullcontext,
                      min_batch: int | None = None) -> Tensor:
    """model(x) in batches, as float32 on device; the caller puts the model in eval mode.

    min_batch: on an out-of-memory error (a GPU job's budget) the batch halves, down to min_batch,
    and the failed batch is tried again; the error is raised at min_batch (default: batch_size)."""
    floor = min(batch_size, min_batch or batch_size)
    out, start = [], 0
    while start < len(x):
        xb = x[start:start + batch_size].to(device, non_blocking=True)
        try:
            with autocast():
                out.append(model(xb).float())
        except torch.OutOfMemoryError:
            if batch_size <= floor:
                raise
            batch_size = max(floor, batch_size // 2)
            continue
        start += len(xb)
    return torch.cat(out)


def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int, device: torch.device,
             autocast: Callable[[], AbstractContextManager] = nullcontext,
             min_batch: int | None = None) -> tuple[float, float, Tensor]:
    """(mean cross-entropy, accuracy, predicted classes) of model on (x, y), in eval mode; batches as
    logits_in_batches() takes them."""
    was_training = model.training
    model.eval()
    try:
        logits = logits_in_batches(model, x, batch_size, device, autocast, min_batch)
    finally:
        model.train(was_training)
    y = y.to(device)
    loss = F.cross_entropy(logits, y, reduction="sum")
    pred = logits.argmax(dim=1)
    correct = (pred == y).sum()
    n = len(y)
    return loss.item() / n, correct.item() / n, pred


def predict(spec: PredictJob, ctx: JobContext, model_dir: Path, train_spec: TrainJob | None = None) -> dict[str, Any]:
    """Class probabilities for spec.inputs, or accuracy and a confusion matrix on spec.data.

    The whole result goes to result.json in ctx.artifact_dir (GET /jobs/{id}/result serves it);
    the summary returned here is what the job's row keeps, small whatever the rows and classes.
    train_spec defaults to the training job's spec stored in the artifact's meta.json.
    """
    result, summary = _predict(spec, ctx, model_dir, train_spec)
    artifacts.save_json(ctx.artifact_dir / RESULT_FILE, result)
    return summary


def _predict(spec: PredictJob, ctx: JobContext, model_dir: Path,
             train_spec: TrainJob | None) -> tuple[dict[str, Any], dict[str, Any]]:
    model, meta = artifacts.load_model(model_dir, ctx.device)
    if train_spec is None and "spec" in meta:
        train_spec = TrainJob.model_validate(meta["spec"])
    train_data = train_spec.data if train_spec else None
    dataset, pixels = raw_scaling(meta, train_spec)
    input_shape = tuple(meta["input_shape"])
    num_outputs = int(meta["num_classes"])
    class_names = output_names(meta)
    # The precision the model trained and was evaluated in, where this device supports it.
    trained_in = train_spec.train.precision if train_spec else meta.get("precision", "fp32")
    precision, _note = torch_devices.resolve_precision(ctx.device, trained_in)
    autocast = lambda: torch_devices.autocast(ctx.device, precision)  # noqa: E731

    if spec.inputs is not None:
        return _predict_inputs(spec, spec.inputs, ctx, model, input_shape, class_names, dataset, autocast,
                               pixels=pixels)
    if spec.data is None:  # the spec names inputs or data (app/spec checks)
        raise JobError("a predict job needs inputs or data")

    x, y, _names = data.split_for_predict(spec.data, train_data, ctx.data_dir, ctx.device)
    if tuple(x.shape[1:]) != input_shape:
        raise JobError(f"dataset {spec.data.dataset!r} has samples of shape {tuple(x.shape[1:])} "
                       f"but the model takes {input_shape}")
    if len(y) and int(y.max()) >= num_outputs:
        raise JobError(f"dataset {spec.data.dataset!r} has labels up to {int(y.max())} "
                       f"but the model has {num_outputs} outputs")
    loss, accuracy, pred = evaluate(model, x, y, spec.batch_size, ctx.device, autocast)
    k = num_outputs
    y = y.to(ctx.device)
    totals = torch.bincount(y, minlength=k).cpu()
    hits = torch.bincount(y[pred == y], minlength=k).cpu()
    per_class = {name: (hits[i].item() / totals[i].item() if totals[i] else None)
                 for i, name in enumerate(class_names)}
    # k x k counts would be 40 GB at 100,000 classes: bounded, and said so in the result.
    confusion = torch.bincount(y * k + pred, minlength=k * k).reshape(k, k).tolist() \
        if k <= MAX_CONFUSION_CLASSES else None
    ctx.log(f"evaluated {len(y)} samples of {spec.data.dataset} ({spec.data.split}): accuracy {accuracy:.4f}")
    summary = {"samples": len(y), "accuracy": accuracy, "loss": loss, "classes": k,
               "dataset": spec.data.dataset, "split": spec.data.split}
    result = {**summary, "per_class_accuracy": per_class, "confusion_matrix": confusion, "class_names": class_names}
    if confusion is None:
        result["note"] = f"no confusion matrix past {MAX_CONFUSION_CLASSES} classes"
    return result, summary


def raw_scaling(meta: dict[str, Any], train_spec: TrainJob | None) -> tuple[str | None, bool | None]:
    """(dataset, pixels): what data.normalize needs to scale raw input rows as the model's training data
    was. Shared with worker/export.py, whose exported models take the same raw rows."""
    # A run job's model: its meta says what data it expects (a built-in dataset's scaling, pixels or neither).
    return (train_spec.data.dataset if train_spec else meta.get("dataset")), meta.get("pixels")


def output_names(meta: dict[str, Any]) -> list[str]:
    """A name for each of the model's outputs."""
    names = list(meta.get("class_names") or [])
    # A widened output layer (model.num_classes) predicts classes the data had no name for.
    return names + [str(i) for i in range(len(names), int(meta["num_classes"]))]


def _predict_inputs(spec: PredictJob, inputs: list[list[float]], ctx: JobContext, model: nn.Module,
                    input_shape: tuple[int, ...], class_names: list[str], dataset: str | None, autocast,
                    pixels: bool | None = None):
    """Inputs are raw values in the dataset's original scale (iris: cm; digits: 0..16 per pixel;
    mnist, fashion_mnist, cifar10, fake: 0..255 per pixel, channels first, flattened), so they get
    the same normalisation training applied."""
    width = math.prod(input_shape)
    got = len(inputs[0])
    if got != width:
        raise JobError(f"inputs: each row must have {width} values (the model takes samples of shape "
                       f"{input_shape}, flattened), got {got}")
    x = torch.tensor(inputs, dtype=torch.float32).reshape(-1, *input_shape)
    x = data.normalize(dataset, x, pixels)
    model.eval()
    probs = F.softmax(logits_in_batches(model, x, spec.batch_size, ctx.device, autocast), dim=1).cpu()
    bad = (~torch.isfinite(probs).all(dim=1)).nonzero().flatten().tolist()
    if bad:  # inputs within float32's range can still overflow inside the model
        raise JobError(f"the model's outputs overflow (inf or NaN) for {len(bad)} input row(s), first row {bad[0]}: "
                       f"their values are too large for this model")
    top = probs.argmax(dim=1).tolist()
    ctx.log(f"predicted {len(top)} input rows")
    summary = {"predictions": len(top), "classes": len(class_names), "top_k": spec.top_k}
    if spec.top_k is None:
        rows = [{"index": i, "class": class_names[c], "probabilities": p}
                for i, (c, p) in enumerate(zip(top, probs.tolist()))]
    else:
        values, indices = probs.topk(min(spec.top_k, probs.shape[1]), dim=1)
        rows = [{"index": i, "class": class_names[c],
                 "top": [{"class": class_names[j], "probability": p} for j, p in zip(js, ps)]}
                for i, (c, js, ps) in enumerate(zip(top, indices.tolist(), values.tolist()))]
    return {"predictions": rows, "class_names": class_names}, summary
