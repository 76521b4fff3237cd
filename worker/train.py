"""The training loop: build, resume, one epoch, evaluate, summary. Read top to bottom from train().

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
"""
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import nn

from trainyard.app.spec import HIGHER_IS_BETTER, TrainJob, TrainParams
from trainyard.worker import artifacts, augment, data, distributed, infer, nets, schedule, starting, torch_devices
from trainyard.worker.context import JobContext, JobError, Preempted
from trainyard.worker.distributed import World


def train(spec: TrainJob, ctx: JobContext) -> dict[str, Any]:
    """Train spec on ctx.device, write the artifact to ctx.artifact_dir, return the summary.

    Raises JobError when the spec cannot work, Preempted after checkpointing on a stop request;
    a CUDA out-of-memory error propagates (the runner reports it with torch_devices.oom_message()).
    """
    run = build(spec, ctx)
    at = resume(run, ctx)
    on = f"{run.world.size} devices ({ctx.device} and the others)" if run.world.size > 1 else str(ctx.device)
    ctx.log(f"training {spec.model.arch} ({run.parameters:,} parameters) on {spec.data.dataset}: "
            f"{len(run.data.y_train)} train / {len(run.data.y_val)} val samples, {run.steps_per_epoch} steps per "
            f"epoch, {on}, {run.precision}")
    p = spec.train
    epochs, log_every = p.epochs, max(1, p.epochs // 10)
    rates, last, stopped_at = [], None, None
    saved_at = time.monotonic()
    for epoch in range(at.epoch, epochs):  # 0-based here, 1-based in events and logs
        started = time.perf_counter() - (at.partial or {}).get("seconds", 0.0)
        train_loss, seen, train_seconds = train_epoch(run, ctx, epoch, at)
        final = epoch + 1 == epochs
        stop = False
        if run.world.leader:
            rates.append(seen / train_seconds if train_seconds > 0 else 0.0)
            last = {"epoch": epoch + 1, "epochs": epochs, "train_loss": train_loss, "samples_per_s": rates[-1],
                    "lr": run.lr, "effective_batch": run.effective_batch,
                    **run.take_grad_norm()}
            if (epoch + 1) % p.eval_every == 0 or final:
                last["val_loss"], last["val_accuracy"] = evaluate(run)
                stop = run.watch.update(epoch + 1, last, run.model)
            last["seconds"] = time.perf_counter() - started
            ctx.emit({"type": "epoch", **last, **(torch_devices.memory_stats(ctx.device) or {})})
            if epoch == at.epoch or (epoch + 1) % log_every == 0 or final or stop:
                ctx.log(epoch_line(last, epochs))
        # none after the last epoch (the artifact is written instead); every rank hands it its random state
        due = bool(p.checkpoint_every) and (epoch + 1) % p.checkpoint_every == 0 and not final \
            and time.monotonic() - saved_at >= p.checkpoint_every_s
        stop, due = run.agree(stop, due)
        if stop:
            stopped_at = epoch + 1
            if run.world.leader:
                ctx.log(f"early stopping at epoch {stopped_at}: {run.watch.why()}")
                ctx.emit({"type": "total", "epochs": stopped_at})
            break
        if due:
            checkpoint(run, ctx, epoch + 1, 0, run.shuffle.get_state(), None)
            saved_at = time.monotonic()
    return summary(spec, run, ctx, at, last, rates, stopped_at) if run.world.leader else {}


def epoch_line(m: dict[str, Any], epochs: int) -> str:
    val = f" val_loss {m['val_loss']:.4f} val_acc {m['val_accuracy']:.4f}" if "val_loss" in m else ""
    return (f"epoch {m['epoch']}/{epochs} loss {m['train_loss']:.4f}{val} lr {m['lr']:.3g} "
            f"({m['samples_per_s']:,.0f} samples/s)")


# -- build ----------------------------------------------------------------------------------------

@dataclass
class Run:
    """Everything one training run works with, built once by build()."""
    params: TrainParams
    device: torch.device
    data: data.TensorData
    model: nn.Module           # the plain module: its state_dict is what is saved
    forward: nn.Module         # the module batches go through: `model` (in DDP on several devices), maybe compiled
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    shuffle: torch.Generator   # batch order, on the CPU: the same on every device
    applied: dict[str, Any]    # the speed switches as really applied (reported in the result)
    channels_last: bool
    num_outputs: int
    parameters: int
    world: World
    stop_vote: distributed.StopVote  # every rank stops at the same step (one device: the flag itself)
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    watch: "Watch"
    # The epoch's pre-clip gradient norms, summed on the device (read once per epoch); None: not clipping.
    grad_norms: torch.Tensor | None = None
    augment: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None  # (batch, epoch, step) -> batch
    lr: float = 0.0  # the learning rate of the latest optimizer step (reported per epoch)
    ddp: nn.parallel.DistributedDataParallel | None = None  # on several devices: the DDP wrapper of `model`

    @property
    def precision(self) -> str:
        return self.applied["precision"]

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch (an optimizer step is taken every accumulate_steps of them)."""
        return math.ceil(len(self.data.y_train) / (self.params.batch_size * self.world.size))

    @property
    def optimizer_steps_per_epoch(self) -> int:
        return math.ceil(self.steps_per_epoch / self.params.accumulate_steps)

    @property
    def effective_batch(self) -> int:
        return self.params.batch_size * self.params.accumulate_steps * self.world.size

    def take_grad_norm(self) -> dict[str, float]:
        """The epoch's mean pre-clip gradient norm (when clipping), and a fresh sum for the next epoch."""
        if self.grad_norms is None:
            return {}
        total, steps = self.grad_norms.tolist()
        self.grad_norms.zero_()
        mean = total / steps if steps else None
        return {"grad_norm": mean} if mean is not None and math.isfinite(mean) else {}

    def agree(self, stop: bool, due: bool) -> tuple[bool, bool]:
        """Rank 0's end-of-epoch decisions (stop early, checkpoint), the same on every rank."""
        if self.world.size == 1:
            return stop, due
        votes = torch.tensor([float(stop), float(due)], device=self.device) if self.world.leader \
            else torch.zeros(2, device=self.device)
        stop_votes, due_votes = distributed.total(votes, self.world).tolist()
        return stop_votes > 0, due_votes > 0

    def autocast(self) -> ContextManager:
        return torch_devices.autocast(self.device, self.precision)

    def sync(self, last: bool) -> ContextManager:
        """Around a batch's forward and backward: DDP all-reduces the gradients only on the last batch of
        an accumulation group; the others accumulate locally (no_sync), one all-reduce per optimizer step."""
        return nullcontext() if last or self.ddp is None else self.ddp.no_sync()


def build(spec: TrainJob, ctx: JobContext) -> Run:
    p, device, world = spec.train, ctx.device, ctx.world
    applied = torch_devices.configure(device, p)
    torch_devices.reset_peak_memory(device)
    # Data before seeding: whether a dataset comes from its cache or is decoded must not change
    # the random stream the model's initialisation draws from.
    d = data.load(spec.data, ctx.data_dir, device)
    # A dataset over half the job's GPU budget stays in host memory (torch_devices.fits_on_device).
    applied["data"] = "on the device" if d.x_train.device == device else "in host memory"
    # Seeding right before building the model gives the same initial weights for the same seed on
    # every device. Batch order has its own CPU generator, independent of dropout.
    torch.manual_seed(p.seed)
    shuffle = torch.Generator().manual_seed(p.seed)
    model = nets.build_model(spec.model, d.input_shape, len(d.class_names))
    starting.apply(model, spec, d, ctx)
    if world.size > 1 and device.type == "cuda":  # batch statistics over the whole global batch (CUDA only)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    nets.check_input(model, d.input_shape, device, spec.model.arch)
    if world.rank > 0:  # dropout differs between ranks' shards; rank 0 draws what one process would
        torch.manual_seed(p.seed + world.rank)
    torch_devices.fit_cpu_threads(model, d.x_train[:1].to(device), p.batch_size, device, applied)
    channels_last = torch_devices.use_channels_last(p.channels_last, d.input_shape, applied)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(p, model.parameters())
    net = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None) \
        if world.size > 1 else model
    # The warm-up compiles what training runs: a batch of its size (BatchNorm wants two samples at least)
    # on the device and in the memory format of the training batches.
    example = torch_devices.warm_up_batch(d.x_train[:max(2, p.batch_size)], device, channels_last)
    forward = torch_devices.compile_model(net, p.compile, example, applied)
    run = Run(params=p, device=device, data=d, model=model, forward=forward, optimizer=optimizer,
              scaler=torch_devices.grad_scaler(device, applied["precision"]),
              criterion=nn.CrossEntropyLoss(label_smoothing=p.label_smoothing),
              shuffle=shuffle, applied=applied, channels_last=channels_last,
              num_outputs=spec.model.num_classes or len(d.class_names), parameters=nets.count_parameters(model),
              world=world, stop_vote=distributed.StopVote(world), scheduler=None, watch=Watch(p),
              grad_norms=torch.zeros(2, device=device) if p.grad_clip_norm else None,
              augment=augment.BatchAugment(p.augment, p.seed, d.input_shape, world.rank) if p.augment else None,
              ddp=net if net is not model else None)
    run.scheduler = schedule.build(p, optimizer, run.optimizer_steps_per_epoch)
    run.lr = optimizer.param_groups[0]["lr"]
    return run


class Watch:
    """What the evaluated epochs have shown so far: the best one by keep_metric with its weights
    (keep: best), and how many evaluations the early-stopping metric has gone without improving."""

    def __init__(self, p: TrainParams):
        self.keep_metric = p.keep_metric if p.keep == "best" else None
        self.early = p.early_stopping
        self.best: dict[str, Any] | None = None  # epoch, value and metrics of the best evaluated epoch
        self.best_state: dict[str, torch.Tensor] | None = None
        self.early_best: float | None = None
        self.waited = 0

    def update(self, epoch: int, metrics: dict[str, Any], model: nn.Module) -> bool:
        """Take in an evaluated epoch's metrics; True when early stopping says stop."""
        if self.keep_metric and improves(self.keep_metric, metrics[self.keep_metric],
                                         self.best and self.best["value"], 0.0):
            self.best = {"epoch": epoch, "value": metrics[self.keep_metric],
                         "metrics": {k: metrics[k] for k in ("train_loss", "val_loss", "val_accuracy")}}
            # A copy on the device: no wait for it, and one model's memory at most.
            self.best_state = {k: v.detach().clone() for k, v in artifacts.unwrap(model).state_dict().items()}
        if self.early is None:
            return False
        value = metrics[self.early.metric]
        if improves(self.early.metric, value, self.early_best, self.early.min_delta):
            self.early_best, self.waited = value, 0
        else:
            self.waited += 1
        return self.waited >= self.early.patience

    def why(self) -> str:
        e = self.early
        return f"{e.metric} has not improved by more than {e.min_delta} on {self.early_best:.4f} in " \
               f"{self.waited} evaluation(s) (patience {e.patience})"

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_state": self.best_state, "early_best": self.early_best,
                "waited": self.waited}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.best, self.best_state = state["best"], state["best_state"]
            self.early_best, self.waited = state["early_best"], state["waited"]


def improves(metric: str, value: float, best: float | None, min_delta: float) -> bool:
    if best is None:
        return math.isfinite(value)
    return value > best + min_delta if HIGHER_IS_BETTER[metric] else value < best - min_delta


def make_optimizer(p: TrainParams, parameters) -> torch.optim.Optimizer:
    """The optimizer a job's train params ask for (bench/ builds its yardsticks' with this too)."""
    if p.optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
    cls = torch.optim.Adam if p.optimizer == "adam" else torch.optim.AdamW
    return cls(parameters, lr=p.lr, weight_decay=p.weight_decay)


# -- resume ---------------------------------------------------------------------------------------

@dataclass
class Start:
    """Where this run starts: `epoch` epochs done plus `step` batches of the next one."""
    epoch: int = 0
    step: int = 0
    partial: dict[str, Any] | None = None  # the interrupted epoch's loss sum, samples and seconds so far
    resumed: bool = False


def resume(run: Run, ctx: JobContext) -> Start:
    """Load the checkpoint the job resumes from, if any: weights, optimizer, scaler, RNG states, position."""
    ck = ctx.resume_point()
    if ck is None:
        return Start()
    run.model.load_state_dict(ck["model"])
    run.optimizer.load_state_dict(ck["optimizer"])
    artifacts.optimizer_to(run.optimizer, ctx.device)
    if ck["scaler"] is not None:
        run.scaler.load_state_dict(ck["scaler"])
    if run.scheduler is not None and ck.get("scheduler") is not None:
        run.scheduler.load_state_dict(ck["scheduler"])
    run.watch.load_state_dict(ck.get("watch"))
    rng = ck if run.world.rank == 0 else ck["rank_rng"][run.world.rank - 1]
    torch.set_rng_state(rng["torch_rng"])
    torch_devices.set_cuda_rng_state(ctx.device, rng.get("cuda_rng"))
    run.shuffle.set_state(ck["shuffle_rng_at_epoch_start"])
    ctx.log(f"resumed from checkpoint: {ck['epoch']} epochs done, step {ck['step']} of epoch {ck['epoch'] + 1}")
    return Start(epoch=ck["epoch"], step=ck["step"], partial=ck["partial"], resumed=True)


def checkpoint(run: Run, ctx: JobContext, epoch: int, step: int, shuffle_state: torch.Tensor,
               partial: dict[str, Any] | None) -> None:
    """Write the checkpoint: `epoch` epochs done plus `step` batches of the next one. On several devices
    every rank calls this at the same point and rank 0 writes it, with each rank's random state."""
    rng = {"torch_rng": torch.get_rng_state(), "cuda_rng": torch_devices.cuda_rng_state(ctx.device)}
    ranks_rng = distributed.gather(rng, run.world)
    if not run.world.leader:
        return
    state = {
        "epoch": epoch, "step": step,
        "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
        "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
        "scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
        "watch": run.watch.state_dict(),
        **rng, "rank_rng": ranks_rng[1:],
        "shuffle_rng_at_epoch_start": shuffle_state,
        "partial": partial,
    }
    ctx.save_checkpoint(epoch, step, state)


# -- one epoch ------------------------------------------------------------------------------------

def train_epoch(run: Run, ctx: JobContext, epoch: int, at: Start) -> tuple[float, int, float]:
    """Train one epoch (the rest of it, when resuming mid-epoch): (mean loss, samples, seconds)."""
    d, world, device = run.data, run.world, ctx.device
    bs = run.params.batch_size * world.size  # the global batch: each rank trains on its shard
    t0 = time.perf_counter()
    epoch_rng = run.shuffle.get_state()  # regenerates this epoch's order on resume
    n = len(d.y_train)
    # One batch holding every sample: order cannot change the mean loss, so skip the gather.
    perm = None if run.steps_per_epoch == 1 and world.size == 1 \
        else torch.randperm(n, generator=run.shuffle).to(d.x_train.device)
    # The dataset stays in host memory when it does not fit on the GPU: batches are then copied.
    host_batches = d.x_train.device != device
    loss_sum = torch.zeros((), device=device)
    seen, earlier_seconds, first_step = 0, 0.0, 0
    if at.partial is not None:  # resuming in the middle of this epoch (rank 0 holds the ranks' sums)
        if world.leader:
            loss_sum += at.partial["loss_sum"]
            seen = at.partial["count"]
        earlier_seconds, first_step = at.partial["seconds"], at.step
        at.partial = None

    run.model.train()
    k, steps = run.params.accumulate_steps, run.steps_per_epoch
    for step in range(first_step, steps):
        # Only between optimizer steps: a checkpoint cannot hold half-accumulated gradients.
        if step % k == 0 and run.stop_vote(ctx.stop_requested()):
            total, count = over_ranks(loss_sum, seen, world)
            done = {"loss_sum": total.item(), "count": count,
                    "seconds": earlier_seconds + time.perf_counter() - t0} if step > 0 else None
            checkpoint(run, ctx, epoch, step, epoch_rng, done)
            raise Preempted(f"stopped at epoch {epoch + 1}, step {step}; checkpointed")
        count, scale = None, 1.0
        if perm is None:
            xb, yb = d.x_train, d.y_train
        else:
            idx = perm[step * bs:(step + 1) * bs]
            if world.size > 1:
                idx, count, scale = distributed.shard(idx, world)
            xb, yb = d.x_train[idx], d.y_train[idx]
        if host_batches:  # pinned, so the copy overlaps the previous step's work
            xb = xb.pin_memory().to(device, non_blocking=True)
            yb = yb.pin_memory().to(device, non_blocking=True)
        if run.augment is not None:
            xb = run.augment(xb, epoch, step)
        if run.channels_last:
            xb = xb.contiguous(memory_format=torch.channels_last)
        count = len(yb) if count is None else count
        group = step // k * k
        if k > 1:  # each batch's share of the samples its optimizer step takes
            scale *= _samples(step, step + 1, bs, n) / _samples(group, min(group + k, steps), bs, n)
        loss = step_on(run, xb, yb, scale, first=step == group, last=step + 1 == min(group + k, steps))
        if count:
            loss_sum.add_(loss, alpha=count)
            seen += count

    loss_sum, seen = over_ranks(loss_sum, seen, world)
    train_loss = loss_sum.item() / seen  # the epoch's one wait for the device
    if not math.isfinite(train_loss):
        hint = " or use precision fp32" if run.precision != "fp32" else ""
        raise JobError(f"loss became {train_loss} at epoch {epoch + 1}; lower the learning rate "
                       f"(lr is {run.params.lr}){hint}")
    return train_loss, seen, earlier_seconds + time.perf_counter() - t0


def _samples(first: int, end: int, bs: int, n: int) -> int:
    """Samples in batches first..end-1 of an epoch of n samples in batches of bs (the last may be short)."""
    return min(end * bs, n) - first * bs


def over_ranks(loss_sum: torch.Tensor, seen: int, world: World) -> tuple[torch.Tensor, int]:
    """The loss sum and sample count of all ranks together (these themselves on one device)."""
    if world.size == 1:
        return loss_sum, seen
    sums = distributed.total(torch.stack([loss_sum.double(), torch.tensor(float(seen), dtype=torch.float64,
                                                                          device=loss_sum.device)]), world)
    return sums[0], int(sums[1].item())


def step_on(run: Run, xb: torch.Tensor, yb: torch.Tensor, scale: float = 1.0,
            first: bool = True, last: bool = True) -> torch.Tensor:
    """Backward on a batch, and an optimizer step when it is the last of its accumulation group
    (`first` clears the gradients); its mean loss, detached, still on the device. The gradient is
    that of the loss times scale (a rank's share of a global batch: distributed.shard, and the
    batch's share of its group)."""
    if first:
        run.optimizer.zero_grad(set_to_none=True)
    scaler = run.scaler if run.scaler.is_enabled() else None  # fp16 on CUDA: keeps small gradients from flushing
    with run.sync(last):
        with run.autocast():
            logits = run.forward(xb)
        mean = run.criterion(logits.float(), yb)
        loss = mean if scale == 1.0 else mean * scale
        (scaler.scale(loss) if scaler else loss).backward()
    if not last:
        return mean.detach()
    if run.grad_norms is not None:
        if scaler:
            scaler.unscale_(run.optimizer)  # clip the true gradients, not the scaled ones
        norm = nn.utils.clip_grad_norm_(run.model.parameters(), run.params.grad_clip_norm)
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


# -- evaluate and summarise -----------------------------------------------------------------------

def evaluate(run: Run, module: Callable | None = None) -> tuple[float, float]:
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


def summary(spec: TrainJob, run: Run, ctx: JobContext, at: Start, last: dict | None,
            rates: list[float], stopped_at: int | None = None) -> dict[str, Any]:
    """Write the artifact (the kept epoch's weights) and return the job's result."""
    best = run.watch.best
    if best is not None:
        artifacts.load_weights(run.model, run.watch.best_state)
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
        "samples_per_s": sum(rates) / len(rates) if rates else None,
        "input_shape": list(d.input_shape), "num_classes": run.num_outputs, "class_names": d.class_names,
        "parameters": run.parameters, "devices": run.world.size,
        "peak_memory_allocated": memory.get("max_memory_allocated"),
        "peak_memory_reserved": memory.get("max_memory_reserved"),
        "applied": run.applied,
        "resumed_from_epoch": at.epoch if at.resumed else None,
        "resumed_from_step": at.step if at.resumed else None,
        "kept": spec.train.keep, "kept_epoch": best["epoch"] if best else stopped_at or spec.train.epochs,
        "stopped_early_at": stopped_at,
        "started_from": ctx.started_from,
    }
