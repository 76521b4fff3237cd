"""Learning-rate schedules: a job's `train.lr_schedule` as a torch LR scheduler stepped once per optimizer step.

Schedules are per step rather than per epoch so that warm-up works within one epoch and a job
resumed mid-epoch continues on the same curve: the scheduler's state (its step count) is part of
every checkpoint. `lr` in the spec is the peak; warm-up rises linearly from 0 to it.
"""
import math

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR

from trainyard.app.spec import Schedule, TrainParams


def build(p: TrainParams, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> LRScheduler | None:
    """The scheduler of a job's train params (None: lr throughout); steps_per_epoch counts optimizer steps."""
    s = p.lr_schedule
    if s is None:
        return None
    total = max(1, p.epochs * steps_per_epoch)
    warmup = min(total, round(s.warmup_epochs * steps_per_epoch))
    if s.name == "onecycle":
        # torch's own: cosine up to max_lr over pct_start of the run and down to max_lr / 1e4 (div_factor 25 x
        # final_div_factor 1e4), with momentum (or Adam's beta1) cycled against it.
        # Its peak is at step pct_start x total - 1: step `warmup`, as with the other schedules' warm-up.
        pct = (warmup + 1) / total if s.warmup_epochs else 0.3
        return OneCycleLR(optimizer, max_lr=p.lr, total_steps=total, pct_start=min(max(pct, 1 / total), 0.99))
    return LambdaLR(optimizer, lambda step: factor(s, p.lr, step, total, warmup, steps_per_epoch))


def factor(s: Schedule, lr: float, step: int, total: int, warmup: int, steps_per_epoch: int) -> float:
    """The multiple of lr at optimizer step `step` (0-based) of `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if s.name == "constant":
        return 1.0
    if s.name == "step":
        return s.gamma ** ((step // steps_per_epoch) // s.step_epochs)
    # cosine and linear go from lr at the end of warm-up to min_lr at the last step.
    span = max(1, total - 1 - warmup)
    done = min(1.0, (step - warmup) / span)
    shape = 0.5 * (1 + math.cos(math.pi * done)) if s.name == "cosine" else 1 - done
    floor = min(s.min_lr / lr, 1.0)
    return floor + (1 - floor) * shape

