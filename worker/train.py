"""The training loop, read top to bottom: train() runs the epochs, train_epoch() the steps of one,
batch() slices a batch, step_on() takes it forward, backward and (at the end of an accumulation
group) through the optimizer.

Batches are index slices of tensors that already live on the device, and the loop never waits
for the device inside an epoch: the loss accumulates in a device tensor that is read once per
epoch. A checkpoint can be taken at any step boundary and a resumed job continues exactly where
it stopped (same weights, optimizer state, RNG states and batch order).

On several devices (ctx.world, DistributedDataParallel) every rank draws the same global batch of
batch_size x ranks samples and trains on its own shard of it, so that the job takes the steps one
process with the whole batch would; rank 0 alone evaluates, reports, checkpoints and saves.

How the model is fitted (train params): an optimizer step every `accumulate_steps` batches, the
gradient clipped to `grad_clip_norm`, the learning rate moved by `lr_schedule` after each step.
Validation runs every `eval_every` epochs; a Watch keeps the best evaluated weights (`keep: best`)
and counts evaluations without improvement (`early_stopping`). Checkpoints are taken every
`checkpoint_every` epochs once `checkpoint_every_s` seconds have passed since the last, and at
any step boundary when the worker asks the job to stop.

The plumbing lives beside the loop: train_setup builds the Run (data, model, precision and AMP,
channels_last, torch.compile, determinism, CPU threads, DDP), train_checkpoint writes checkpoints and
resumes from them, train_report reports epochs, validates and writes the result, train_watch keeps
the best epoch and decides early stops.
"""
import math
import time
from typing import Any

import torch
from torch import nn

from trainyard.app.spec import TrainJob
from trainyard.worker import distributed
from trainyard.worker.errors import JobError
from trainyard.worker.job_context import JobContext
from trainyard.worker.leader_wait import leader_alone
from trainyard.worker.train_checkpoint import Start, checkpoint, preempt, resume
from trainyard.worker.train_report import Report, summary
from trainyard.worker.train_setup import Run, build


def train(spec: TrainJob, ctx: JobContext) -> dict[str, Any]:
    """Train spec on ctx.device, write the artifact to ctx.artifact_dir, return the summary.

    Raises JobError when the spec cannot work, Preempted after checkpointing on a stop request;
    a CUDA out-of-memory error propagates (the runner reports it with torch_devices.oom_message()).
    """
    run = build(spec, ctx)
    at = resume(run, ctx)
    p = spec.train
    report = Report(run, ctx, p.epochs, at)
    report.opening(spec)
    saved_at = time.monotonic()
    for epoch in range(at.epoch, p.epochs):  # 0-based here, 1-based in events and logs
        started = time.perf_counter() - (at.partial or {}).get("seconds", 0.0)
        train_loss, seen, train_seconds = train_epoch(run, ctx, epoch, at)
        with leader_alone(run.world, "epoch"):  # rank 0 evaluates: the others wait by the store, not in agree()
            stop = run.world.leader and report.epoch(epoch, train_loss, seen, train_seconds, started)
        # None after the last epoch (the artifact is written instead); every rank hands it its random state.
        due = bool(p.checkpoint_every) and (epoch + 1) % p.checkpoint_every == 0 and epoch + 1 < p.epochs \
            and time.monotonic() - saved_at >= p.checkpoint_every_s
        stop, due = run.agree(stop, due)
        if stop:
            report.stopped(epoch + 1)
            break
        if due:
            checkpoint(run, ctx, epoch + 1, 0, run.shuffle.get_state(), None)
            saved_at = time.monotonic()
    return summary(spec, report) if run.world.leader else {}


def train_epoch(run: Run, ctx: JobContext, epoch: int, at: Start) -> tuple[float, int, float]:
    """Train one epoch (the rest of it, when resuming mid-epoch): (mean loss, samples, seconds)."""
    t0 = time.perf_counter()
    epoch_rng = run.shuffle.get_state()  # regenerates this epoch's order on resume
    k, steps, bs = run.params.accumulate_steps, run.steps_per_epoch, run.global_batch
    # One batch holding every sample: order cannot change the mean loss, so skip the gather.
    order = None if steps == 1 and run.world.size == 1 \
        else torch.randperm(len(run.data.y_train), generator=run.shuffle).to(run.data.x_train.device)
    loss_sum = torch.zeros((), device=run.device)
    first_step, seen, earlier_seconds = continue_epoch(run, at, loss_sum)
    run.train_mode()
    for step in range(first_step, steps):
        if step % k == 0 and run.stop_vote(ctx.stop_requested()):
            preempt(run, ctx, epoch, step, epoch_rng, loss_sum, seen, earlier_seconds + time.perf_counter() - t0)
        xb, yb, count, scale = batch(run, order, bs, epoch, step)
        group, end = step // k * k, min(step // k * k + k, steps)
        if k > 1:  # each batch's share of the samples its optimizer step takes
            n = len(run.data.y_train)
            scale *= _samples(step, step + 1, bs, n) / _samples(group, end, bs, n)
        loss = step_on(run, xb, yb, scale, first=step == group, last=step + 1 == end)
        if count:
            loss_sum.add_(loss, alpha=count)
            seen += count
    loss_sum, seen = run.over_ranks(loss_sum, seen)
    train_loss = loss_sum.item() / seen  # the epoch's one wait for the device
    if not math.isfinite(train_loss):
        hint = " or use precision fp32" if run.precision != "fp32" else ""
        raise JobError(f"loss became {train_loss} at epoch {epoch + 1}; lower the learning rate "
                       f"(lr is {run.params.lr}){hint}")
    return train_loss, seen, earlier_seconds + time.perf_counter() - t0


def continue_epoch(run: Run, at: Start, loss_sum: torch.Tensor) -> tuple[int, int, float]:
    """(first step, samples seen, seconds spent): where an epoch interrupted by a checkpoint left off
    (rank 0 holds the ranks' sums, added to loss_sum), or the start of a fresh one."""
    if at.partial is None:
        return 0, 0, 0.0
    seen = 0
    if run.world.leader:
        loss_sum += at.partial["loss_sum"]
        seen = at.partial["count"]
    first_step, seconds = at.step, at.partial["seconds"]
    at.partial = None
    return first_step, seen, seconds


def batch(run: Run, order: torch.Tensor | None, bs: int, epoch: int,
          step: int) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """Batch `step` of the epoch (`order` its shuffled indices; None: one batch of everything) on the device,
    ready for the model: (inputs, labels, the samples this rank counts, the scale of its loss)."""
    d = run.data
    count, scale = None, 1.0
    if order is None:
        xb, yb = d.x_train, d.y_train
    else:
        idx = order[step * bs:(step + 1) * bs]
        if run.world.size > 1:  # this rank's shard of the global batch
            idx, count, scale = distributed.shard(idx, run.world)
        xb, yb = d.x_train[idx], d.y_train[idx]
    if run.host_batches:  # pinned, so the copy overlaps the previous step's work
        xb = xb.pin_memory().to(run.device, non_blocking=True)
        yb = yb.pin_memory().to(run.device, non_blocking=True)
    if run.augment is not None:
        xb = run.augment(xb, epoch, step)
    if run.channels_last:
        xb = xb.contiguous(memory_format=torch.channels_last)
    return xb, yb, len(yb) if count is None else count, scale


def _samples(first: int, end: int, bs: int, n: int) -> int:
    """Samples in batches first..end-1 of an epoch of n samples in batches of bs (the last may be short)."""
    return min(end * bs, n) - first * bs


def step_on(run: Run, xb: torch.Tensor, yb: torch.Tensor, scale: float = 1.0,
            first: bool = True, last: bool = True) -> torch.Tensor:
    """Backward on a batch, and an optimizer step when it is the last of its accumulation group
    (`first` clears the gradients); its mean loss, detached, still on the device. The gradient is
    that of the loss times scale (a rank's share of a global batch: distributed.shard, and the
    batch's share of its group)."""
    if first:
        run.optimizer.zero_grad(set_to_none=True)
    scaler = run.scaler if run.scaler.is_enabled() else None  # fp16 on CUDA: keeps small gradients from flushing
    if run.plain:  # fp32 on one device: no autocast to enter, no DDP to steer, nothing to scale
        mean = run.criterion(run.forward(xb), yb)
        (mean if scale == 1.0 else mean * scale).backward()
    else:
        with run.sync(last):
            with run.autocast():
                logits = run.forward(xb)
            mean = run.criterion(logits.float(), yb)
            loss = mean if scale == 1.0 else mean * scale
            (scaler.scale(loss) if scaler else loss).backward()
    if not last:
        return mean.detach()
    clip = run.params.grad_clip_norm
    if run.grad_norms is not None and clip:
        if scaler:
            scaler.unscale_(run.optimizer)  # clip the true gradients, not the scaled ones
        norm = nn.utils.clip_grad_norm_(run.model.parameters(), clip)
        run.grad_norms.add_(torch.stack([norm.to(run.grad_norms), torch.ones_like(run.grad_norms[0])]))
    if scaler:
        scaler.step(run.optimizer)
        scaler.update()
    else:
        run.optimizer.step()
    if run.scheduler is not None:
        run.lr = run.optimizer.param_groups[0]["lr"]
        run.scheduler.step()
    return mean.detach()
