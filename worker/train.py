"""The training loop: build, resume, one epoch, evaluate, summary. Read top to bottom from train().

Batches are index slices of tensors that already live on the device, and the loop never waits
for the device inside an epoch: the loss accumulates in a device tensor that is read once per
epoch. A checkpoint can be taken at any step boundary and a resumed job continues exactly where
it stopped (same weights, optimizer state, RNG states and batch order).

On several devices (ctx.world, DistributedDataParallel) every rank draws the same global batch of
batch_size x ranks samples and trains on its own shard of it, so that the job takes the steps one
process with the whole batch would; rank 0 alone evaluates, reports, checkpoints and saves.
"""
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from trainyard.app.spec import TrainJob, TrainParams
from trainyard.worker import artifacts, data, distributed, infer, nets, torch_devices
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
    epochs, log_every = spec.train.epochs, max(1, spec.train.epochs // 10)
    rates, last = [], None
    for epoch in range(at.epoch, epochs):  # 0-based here, 1-based in events and logs
        started = time.perf_counter() - (at.partial or {}).get("seconds", 0.0)
        train_loss, seen, train_seconds = train_epoch(run, ctx, epoch, at)
        every = spec.train.checkpoint_every
        due = every and (epoch + 1) % every == 0 and epoch + 1 < epochs  # none after the last: the artifact
        if not run.world.leader:
            if due:  # rank 0 writes it; every rank hands it its random state
                checkpoint(run, ctx, epoch + 1, 0, run.shuffle.get_state(), None)
            continue
        val_loss, val_accuracy = evaluate(run)
        rates.append(seen / train_seconds if train_seconds > 0 else 0.0)
        last = {"epoch": epoch + 1, "epochs": epochs, "train_loss": train_loss, "val_loss": val_loss,
                "val_accuracy": val_accuracy, "samples_per_s": rates[-1], "seconds": time.perf_counter() - started}
        ctx.emit({"type": "epoch", **last, **(torch_devices.memory_stats(ctx.device) or {})})
        if epoch == at.epoch or (epoch + 1) % log_every == 0 or epoch + 1 == epochs:
            ctx.log(f"epoch {epoch + 1}/{epochs} loss {train_loss:.4f} val_loss {val_loss:.4f} "
                    f"val_acc {val_accuracy:.4f} ({rates[-1]:,.0f} samples/s)")
        if due:
            checkpoint(run, ctx, epoch + 1, 0, run.shuffle.get_state(), None)
    return summary(spec, run, ctx, at, last, rates) if run.world.leader else {}


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

    @property
    def precision(self) -> str:
        return self.applied["precision"]

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.data.y_train) / (self.params.batch_size * self.world.size))

    def autocast(self) -> ContextManager:
        return torch_devices.autocast(self.device, self.precision)


def build(spec: TrainJob, ctx: JobContext) -> Run:
    p, device, world = spec.train, ctx.device, ctx.world
    applied = torch_devices.configure(device, p)
    torch_devices.reset_peak_memory(device)
    # Data before seeding: whether a dataset comes from its cache or is decoded must not change
    # the random stream the model's initialisation draws from.
    d = data.load(spec.data, ctx.data_dir, device)
    # Seeding right before building the model gives the same initial weights for the same seed on
    # every device. Batch order has its own CPU generator, independent of dropout.
    torch.manual_seed(p.seed)
    shuffle = torch.Generator().manual_seed(p.seed)
    model = nets.build_model(spec.model, d.input_shape, len(d.class_names))
    if world.size > 1 and device.type == "cuda":  # batch statistics over the whole global batch (CUDA only)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    nets.check_input(model, d.input_shape, device, spec.model.arch)
    if world.rank > 0:  # dropout differs between ranks' shards; rank 0 draws what one process would
        torch.manual_seed(p.seed + world.rank)
    channels_last = torch_devices.use_channels_last(p.channels_last, d.input_shape, applied)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(p, model.parameters())
    net = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None) \
        if world.size > 1 else model
    forward = torch_devices.compile_model(net, p.compile, d.x_train[:2], applied)
    return Run(params=p, device=device, data=d, model=model, forward=forward, optimizer=optimizer,
               scaler=torch_devices.grad_scaler(device, applied["precision"]), criterion=nn.CrossEntropyLoss(),
               shuffle=shuffle, applied=applied, channels_last=channels_last,
               num_outputs=spec.model.num_classes or len(d.class_names), parameters=nets.count_parameters(model),
               world=world, stop_vote=distributed.StopVote(world))


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
    for step in range(first_step, run.steps_per_epoch):
        if run.stop_vote(ctx.stop_requested()):
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
        if run.channels_last:
            xb = xb.contiguous(memory_format=torch.channels_last)
        count = len(yb) if count is None else count
        loss = step_on(run, xb, yb, scale)
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


def over_ranks(loss_sum: torch.Tensor, seen: int, world: World) -> tuple[torch.Tensor, int]:
    """The loss sum and sample count of all ranks together (these themselves on one device)."""
    if world.size == 1:
        return loss_sum, seen
    sums = distributed.total(torch.stack([loss_sum.double(), torch.tensor(float(seen), dtype=torch.float64,
                                                                          device=loss_sum.device)]), world)
    return sums[0], int(sums[1].item())


def step_on(run: Run, xb: torch.Tensor, yb: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """One optimizer step on a batch; its mean loss, detached, still on the device. The gradient is
    that of the loss times scale (a rank's share of a global batch: distributed.shard)."""
    with run.autocast():
        logits = run.forward(xb)
    mean = run.criterion(logits.float(), yb)
    loss = mean if scale == 1.0 else mean * scale
    run.optimizer.zero_grad(set_to_none=True)
    if run.scaler.is_enabled():  # fp16 on CUDA: the scaler keeps small gradients from flushing to zero
        run.scaler.scale(loss).backward()
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        loss.backward()
        run.optimizer.step()
    return mean.detach()


# -- evaluate and summarise -----------------------------------------------------------------------

def evaluate(run: Run, module: Callable | None = None) -> tuple[float, float]:
    """(loss, accuracy) on the validation split, through the same evaluation a predict job uses."""
    d = run.data
    # Not through DDP: only rank 0 evaluates, and DDP's forward would wait for the other ranks.
    module = module or (run.model if run.world.size > 1 else run.forward)
    loss, accuracy, _ = infer.evaluate(module, d.x_val, d.y_val,
                                       max(run.params.batch_size, infer.EVAL_MIN_BATCH), run.device, run.autocast)
    return loss, accuracy


def summary(spec: TrainJob, run: Run, ctx: JobContext, at: Start, last: dict | None,
            rates: list[float]) -> dict[str, Any]:
    """Write the artifact and return the job's result."""
    if last is None:  # nothing left to run (a checkpoint of a finished run): report the model as it is
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
    }
