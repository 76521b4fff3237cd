"""Checkpoints of a training run, and resuming from one: at any step boundary, with everything needed
to continue exactly where it stopped (weights, optimizer, scaler, scheduler, kept-best state, every
rank's RNG states, the epoch's batch order and the interrupted epoch's loss sum so far)."""
import base64
from dataclasses import dataclass
from typing import Any

import torch

from trainyard.worker import artifacts, distributed, torch_devices
from trainyard.worker.errors import Preempted, RankMessageRefused
from trainyard.worker.job_context import JobContext
from trainyard.worker.leader_wait import leader_alone
from trainyard.worker.train_setup import Run


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
    run.optimizer.load_state_dict(own_loop(run.optimizer, ck["optimizer"]))
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


def _text(state: torch.Tensor | None) -> str | None:
    """A random state (a uint8 tensor) as gather() carries it: base64 in JSON, never a pickle."""
    return None if state is None else base64.b64encode(state.numpy().tobytes()).decode()


def _rank_states(sent: list[Any]) -> list[dict[str, torch.Tensor | None]]:
    """The ranks' random states, as tensors again, from what gather() brought rank 0."""
    def state(text: Any) -> torch.Tensor | None:
        return None if text is None else torch.frombuffer(bytearray(base64.b64decode(text, validate=True)),
                                                          dtype=torch.uint8)
    try:
        return [{"torch_rng": state(got["torch_rng"]), "cuda_rng": state(got["cuda_rng"])} for got in sent]
    except (TypeError, KeyError, ValueError) as exc:  # binascii.Error is a ValueError
        raise RankMessageRefused("a rank's random state is not two base64 texts: refused") from exc


def own_loop(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """saved (an optimizer's state_dict) with optimizer's own choice of loop, fused or foreach, in its groups.
    load_state_dict takes the groups' every setting from the checkpoint: one written before the service's
    optimizer was fused (git 06bff70), or by a run that could not fuse, would bring its loop back while
    applied.optimizer said "fused". Set before loading, so that fused `step` counters go to the device."""
    groups = [{**group, **{k: own[k] for k in ("fused", "foreach") if k in own}}
              for group, own in zip(saved["param_groups"], optimizer.param_groups)]
    return {**saved, "param_groups": groups}


def checkpoint(run: Run, ctx: JobContext, epoch: int, step: int, shuffle_state: torch.Tensor,
               partial: dict[str, Any] | None) -> None:
    """Write the checkpoint: `epoch` epochs done plus `step` batches of the next one. On several devices
    every rank calls this at the same point and rank 0 writes it, with each rank's random state."""
    rng = {"torch_rng": torch.get_rng_state(), "cuda_rng": torch_devices.cuda_rng_state(ctx.device)}
    sent = distributed.gather({k: _text(v) for k, v in rng.items()}, run.world)
    # Writing and uploading it may take long: the other ranks, their random states handed over, wait by the
    # store, not in the next step's all-reduce, which would time out.
    with leader_alone(run.world, "checkpoint"):
        if sent is not None:
            _write(run, ctx, epoch, step, rng, _rank_states(sent), shuffle_state, partial)


def _write(run: Run, ctx: JobContext, epoch: int, step: int, rng: dict[str, torch.Tensor | None],
           ranks_rng: list[dict[str, torch.Tensor | None]], shuffle_state: torch.Tensor,
           partial: dict[str, Any] | None) -> None:
    """Rank 0: the checkpoint's state, written and published."""
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


def preempt(run: Run, ctx: JobContext, epoch: int, step: int, shuffle_state: torch.Tensor,
            loss_sum: torch.Tensor, seen: int, seconds: float) -> None:
    """The worker asked to stop: checkpoint at this step boundary (with the epoch's loss so far) and raise
    Preempted. Only between optimizer steps: a checkpoint cannot hold half-accumulated gradients."""
    total, count = run.over_ranks(loss_sum, seen)
    done = {"loss_sum": total.item(), "count": count, "seconds": seconds} if step > 0 else None
    checkpoint(run, ctx, epoch, step, shuffle_state, done)
    raise Preempted(f"stopped at epoch {epoch + 1}, step {step}; checkpointed")

