"""The training loop: data, model, optimizer, resume, epochs, checkpoints, artifact. Read top to bottom.

Batches are index slices of tensors that already live on the device, and the loop never waits
for the device inside an epoch: the loss accumulates in a device tensor that is
read once per epoch. A checkpoint can be taken at any step boundary and a resumed job continues
exactly where it stopped (same weights, optimizer state, RNG states and batch order).
"""
import math
import time
from typing import Any

import torch
from torch import nn

from app.spec import TrainJob
from worker import artifacts, data, devices, infer, nets
from worker.context import JobContext, JobError, Preempted


def train(spec: TrainJob, ctx: JobContext) -> dict[str, Any]:
    """Train spec on ctx.device, write the artifact to ctx.artifact_dir, return the summary.

    Raises JobError when the spec cannot work, Preempted after checkpointing on a stop request;
    a CUDA out-of-memory error propagates (the runner reports it with devices.oom_message()).
    """
    p, device = spec.train, ctx.device
    applied = devices.configure(device, p)
    precision = applied["precision"]
    devices.reset_peak_memory(device)

    # Data before seeding: whether a dataset comes from its cache or is decoded must not change
    # the random stream the model's initialisation draws from.
    d = data.load(spec.data, ctx.data_dir, device)
    n_train, bs = len(d.y_train), p.batch_size
    steps_per_epoch = math.ceil(n_train / bs)
    full_batch = steps_per_epoch == 1
    # The dataset stays in host memory when it does not fit on the GPU: batches are then copied.
    host_batches = d.x_train.device != device

    # Seeding right before building the model gives the seed tutorials' initial weights. Batch order
    # has its own CPU generator, so it is the same on every device and independent of dropout.
    torch.manual_seed(p.seed)
    shuffle = torch.Generator().manual_seed(p.seed)
    model = nets.build_model(spec.model, d.input_shape, len(d.class_names)).to(device)
    num_outputs = spec.model.num_classes or len(d.class_names)
    nets.check_input(model, d.input_shape, device, spec.model.arch)
    channels_last = devices.use_channels_last(p.channels_last, d.input_shape, applied)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)

    if p.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
    elif p.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=p.lr, weight_decay=p.weight_decay)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=p.weight_decay)
    scaler = devices.grad_scaler(device, precision)
    scaled = scaler.is_enabled()
    criterion = nn.CrossEntropyLoss()
    # `model` stays the plain module (its state_dict is what we save); `forward` may be compiled.
    forward = devices.compile_model(model, p.compile, d.x_train[:2], applied)

    start_epoch, start_step, partial, resumed_from = 0, 0, None, None
    if ctx.resume_path is not None and ctx.resume_path.exists():
        ck = artifacts.load_checkpoint(ctx.resume_path)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        artifacts.optimizer_to(optimizer, device)
        if ck["scaler"] is not None:
            scaler.load_state_dict(ck["scaler"])
        torch.set_rng_state(ck["torch_rng"])
        devices.set_cuda_rng_state(device, ck.get("cuda_rng"))
        shuffle.set_state(ck["shuffle_rng_at_epoch_start"])
        start_epoch, start_step, partial = ck["epoch"], ck["step"], ck["partial"]
        resumed_from = start_epoch
        ctx.log(f"resumed from checkpoint: {start_epoch} epochs done, step {start_step} of epoch {start_epoch + 1}")
    elif ctx.resume_path is not None:
        ctx.log(f"no checkpoint at {ctx.resume_path}; starting from scratch")

    n_params = nets.count_parameters(model)
    ctx.log(f"training {spec.model.arch} ({n_params:,} parameters) on {spec.data.dataset}: {n_train} train / "
            f"{len(d.y_val)} val samples, {steps_per_epoch} steps per epoch, {device}, {precision}")
    autocast = lambda: devices.autocast(device, precision)  # noqa: E731
    log_every = max(1, p.epochs // 10)
    rates, last = [], None

    for epoch in range(start_epoch, p.epochs):  # 0-based here, 1-based in events and logs
        t0 = time.perf_counter()
        epoch_rng = shuffle.get_state()  # regenerates this epoch's order on resume
        # One batch holding every sample: order cannot change the mean loss, so skip the gather.
        perm = None if full_batch else torch.randperm(n_train, generator=shuffle).to(d.x_train.device)
        loss_sum = torch.zeros((), device=device)
        seen, earlier_seconds, first_step = 0, 0.0, 0
        if partial is not None:  # resuming in the middle of this epoch
            loss_sum += partial["loss_sum"]
            seen, earlier_seconds, first_step = partial["count"], partial["seconds"], start_step
            partial = None

        model.train()
        for step in range(first_step, steps_per_epoch):
            if ctx.stop_requested():
                done = {"loss_sum": loss_sum.item(), "count": seen,
                        "seconds": earlier_seconds + time.perf_counter() - t0} if step > 0 else None
                _checkpoint(ctx, model, optimizer, scaler, epoch, step, epoch_rng, done)
                raise Preempted(f"stopped at epoch {epoch + 1}, step {step}; checkpointed")
            if perm is None:
                xb, yb = d.x_train, d.y_train
            else:
                idx = perm[step * bs:(step + 1) * bs]
                xb, yb = d.x_train[idx], d.y_train[idx]
            if host_batches:  # pinned, so the copy overlaps the previous step's work
                xb = xb.pin_memory().to(device, non_blocking=True)
                yb = yb.pin_memory().to(device, non_blocking=True)
            if channels_last:
                xb = xb.contiguous(memory_format=torch.channels_last)
            with autocast():
                logits = forward(xb)
            loss = criterion(logits.float(), yb)
            optimizer.zero_grad(set_to_none=True)
            if scaled:  # fp16 on CUDA: the scaler keeps small gradients from flushing to zero
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            loss_sum.add_(loss.detach(), alpha=len(yb))
            seen += len(yb)

        train_loss = loss_sum.item() / seen  # the epoch's one wait for the device
        train_seconds = earlier_seconds + time.perf_counter() - t0
        if not math.isfinite(train_loss):
            hint = " or use precision fp32" if precision != "fp32" else ""
            raise JobError(f"loss became {train_loss} at epoch {epoch + 1}; lower the learning rate "
                           f"(lr is {p.lr}){hint}")
        val_loss, val_accuracy, _ = infer.evaluate(forward, d.x_val, d.y_val, max(bs, infer.EVAL_MIN_BATCH),
                                                   device, autocast)
        rates.append(seen / train_seconds if train_seconds > 0 else 0.0)
        last = {"epoch": epoch + 1, "epochs": p.epochs, "train_loss": train_loss,
                "val_loss": val_loss, "val_accuracy": val_accuracy, "samples_per_s": rates[-1],
                "seconds": earlier_seconds + time.perf_counter() - t0}
        ctx.emit({"type": "epoch", **last, **(devices.memory_stats(device) or {})})
        if epoch == start_epoch or (epoch + 1) % log_every == 0 or epoch + 1 == p.epochs:
            ctx.log(f"epoch {epoch + 1}/{p.epochs} loss {train_loss:.4f} val_loss {val_loss:.4f} "
                    f"val_acc {val_accuracy:.4f} ({rates[-1]:,.0f} samples/s)")

        # No checkpoint after the last epoch: the artifact below replaces it.
        if p.checkpoint_every and (epoch + 1) % p.checkpoint_every == 0 and epoch + 1 < p.epochs:
            _checkpoint(ctx, model, optimizer, scaler, epoch + 1, 0, shuffle.get_state(), None)

    if last is None:  # nothing left to run (a checkpoint of a finished run): report the model as it is
        val_loss, val_accuracy, _ = infer.evaluate(model, d.x_val, d.y_val, max(bs, infer.EVAL_MIN_BATCH),
                                                   device, autocast)
        last = {"train_loss": None, "val_loss": val_loss, "val_accuracy": val_accuracy}

    meta = {"spec": spec.model_dump(mode="json"), "input_shape": list(d.input_shape), "num_classes": num_outputs,
            "pixels": d.pixels,
            "class_names": d.class_names, "precision": precision}
    artifacts.save_artifact(ctx.artifact_dir, model, meta)
    memory = devices.memory_stats(device) or {}
    return {
        "epochs": p.epochs,
        "train_loss": last["train_loss"],
        "val_loss": last["val_loss"], "val_accuracy": last["val_accuracy"],
        "samples_per_s": sum(rates) / len(rates) if rates else None,
        "input_shape": list(d.input_shape), "num_classes": num_outputs, "class_names": d.class_names,
        "parameters": n_params,
        "peak_memory_allocated": memory.get("max_memory_allocated"),
        "peak_memory_reserved": memory.get("max_memory_reserved"),
        "applied": applied,
        "resumed_from_epoch": resumed_from,
        "resumed_from_step": start_step if resumed_from is not None else None,
    }


def _checkpoint(ctx: JobContext, model: nn.Module, optimizer: torch.optim.Optimizer,
                scaler: torch.amp.GradScaler, epoch: int, step: int, shuffle_state: torch.Tensor,
                partial: dict[str, Any] | None) -> None:
    """Write the checkpoint: `epoch` epochs done plus `step` batches of the next one."""
    state = {
        "epoch": epoch, "step": step,
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "torch_rng": torch.get_rng_state(), "cuda_rng": devices.cuda_rng_state(ctx.device),
        "shuffle_rng_at_epoch_start": shuffle_state,
        "partial": partial,
    }
    path = ctx.checkpoint_file(epoch, step)
    artifacts.save_checkpoint(path, state)
    ctx.emit({"type": "checkpoint", "epoch": epoch, "step": step, "path": str(path)})
