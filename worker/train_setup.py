"""What a training run works with (Run) and how build() makes it from the spec: the data on the device,
the seeded model, and the speed and numerics switches (precision/AMP, channels_last, torch.compile,
determinism, CPU threads, DistributedDataParallel on several devices), each recorded as applied."""
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainyard.app.spec import TrainJob, TrainParams
from trainyard.worker import augment, data, distributed, nets, schedule, starting, torch_devices, train_threads
from trainyard.worker.distributed import World
from trainyard.worker.job_context import JobContext
from trainyard.worker.stop_vote import StopVote
from trainyard.worker.train_watch import Watch


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
    stop_vote: StopVote  # every rank stops at the same step (one device: the flag itself)
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    watch: Watch
    # The epoch's pre-clip gradient norms, summed on the device (read once per epoch); None: not clipping.
    grad_norms: torch.Tensor | None = None
    augment: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None  # (batch, epoch, step) -> batch
    lr: float = 0.0  # the learning rate of the latest optimizer step (reported per epoch)
    ddp: nn.parallel.DistributedDataParallel | None = None  # on several devices: the DDP wrapper of `model`
    # The dataset stays in host memory when it does not fit on the GPU: batches are then copied.
    host_batches: bool = False
    # fp32 on one device: step_on goes straight forward and backward (the contexts it skips cost
    # microseconds a step, a few per cent of a tiny model's).
    plain: bool = False
    modules: list[nn.Module] = field(default_factory=list)  # model.modules(), listed once for train_mode()

    @property
    def precision(self) -> str:
        return self.applied["precision"]

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch (an optimizer step is taken every accumulate_steps of them)."""
        return math.ceil(len(self.data.y_train) / (self.params.batch_size * self.world.size))

    @property
    def global_batch(self) -> int:
        """The samples of one step on all ranks together (each trains on its shard)."""
        return self.params.batch_size * self.world.size

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

    def over_ranks(self, loss_sum: torch.Tensor, seen: int) -> tuple[torch.Tensor, int]:
        """The loss sum and sample count of all ranks together (these themselves on one device)."""
        if self.world.size == 1:
            return loss_sum, seen
        sums = distributed.total(torch.stack([loss_sum.double(), torch.tensor(
            float(seen), dtype=torch.float64, device=loss_sum.device)]), self.world)
        return sums[0], int(sums[1].item())

    def train_mode(self) -> None:
        """Every module in training mode: evaluation puts back the mode it found, so this is mostly a check
        (model.train() sets every module's flag through nn.Module.__setattr__: 30 µs on a 3-layer MLP,
        5% of an Iris epoch)."""
        if not all(m.training for m in self.modules):
            self.model.train()

    def autocast(self) -> AbstractContextManager:
        return torch_devices.autocast(self.device, self.precision)

    def sync(self, last: bool) -> AbstractContextManager:
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
    model, channels_last = _model(spec, ctx, d, applied)
    optimizer = make_optimizer(p, model, applied)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None) \
        if world.size > 1 else None
    net = model if ddp is None else ddp
    # The warm-up compiles what training runs: a batch of its size (BatchNorm wants two samples at least)
    # on the device and in the memory format of the training batches.
    example = torch_devices.warm_up_batch(d.x_train[:max(2, p.batch_size)], device, channels_last)
    forward = torch_devices.compile_model(net, p.compile, example, applied,
                                          lambda: torch_devices.autocast(device, applied["precision"]))
    run = Run(params=p, device=device, data=d, model=model, forward=forward, optimizer=optimizer,
              scaler=torch_devices.grad_scaler(device, applied["precision"]),
              criterion=nn.CrossEntropyLoss(label_smoothing=p.label_smoothing),
              # Batch order has its own CPU generator, independent of dropout.
              shuffle=torch.Generator().manual_seed(p.seed), applied=applied, channels_last=channels_last,
              num_outputs=spec.model.num_classes or len(d.class_names), parameters=nets.count_parameters(model),
              world=world, stop_vote=StopVote(world), scheduler=None, watch=Watch(p),
              grad_norms=torch.zeros(2, device=device) if p.grad_clip_norm else None,
              augment=augment.BatchAugment(p.augment, p.seed, d.input_shape, world.rank) if p.augment else None,
              ddp=ddp, host_batches=d.x_train.device != device)
    run.plain, run.modules = run.precision == "fp32" and ddp is None, list(model.modules())
    run.scheduler = schedule.build(p, optimizer, run.optimizer_steps_per_epoch)
    run.lr = optimizer.param_groups[0]["lr"]
    return run


def _model(spec: TrainJob, ctx: JobContext, d: data.TensorData, applied: dict[str, Any]) -> tuple[nn.Module, bool]:
    """The seeded model on the device, in the memory format training uses (and whether that is channels_last);
    the CPU thread count fitted to its step."""
    p, device, world = spec.train, ctx.device, ctx.world
    # Seeding right before building the model gives the same initial weights for the same seed on every device.
    torch.manual_seed(p.seed)
    model = nets.build_model(spec.model, d.input_shape, len(d.class_names))
    starting.apply(model, spec, d, ctx)
    if world.size > 1 and device.type == "cuda":  # batch statistics over the whole global batch (CUDA only)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    nets.check_input(model, d.input_shape, device, spec.model.arch)
    if world.rank > 0:  # dropout differs between ranks' shards; rank 0 draws what one process would
        torch.manual_seed(p.seed + world.rank)
    train_threads.fit(model, d.x_train[:min(p.batch_size, train_threads.PROBE_ROWS)].to(device), p.batch_size,
                      device, applied, p.deterministic)
    channels_last = torch_devices.use_channels_last(p.channels_last, d.input_shape, applied)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, channels_last


def make_optimizer(p: TrainParams, model: nn.Module, applied: dict[str, Any] | None = None) -> torch.optim.Optimizer:
    """The optimizer a job's train params ask for, over model's parameters (bench/ builds its yardsticks' with
    this too). PyTorch's fused kernel where it has one for every parameter (floating point, on the CPU or CUDA;
    no sparse gradients): one call per step instead of several per parameter tensor, 20-30% of an Iris step on
    the CPU. It rounds differently from the per-tensor loop, by about 1e-8 a step. applied["optimizer"]:
    "fused" or "per-tensor"."""
    params = list(model.parameters())
    fused = all(type(t) is nn.Parameter and t.is_floating_point() and t.device.type in ("cpu", "cuda")
                for t in params) and not any(getattr(m, "sparse", False) is True for m in model.modules())
    if applied is not None:
        applied["optimizer"] = "fused" if fused else "per-tensor"
    # The kernel is checked for at the first step, not here: what it cannot take is ruled out above.
    flag = True if fused else None  # None: PyTorch's default loop
    if p.optimizer == "sgd":
        return torch.optim.SGD(params, lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay, fused=flag)
    cls = torch.optim.Adam if p.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=p.lr, weight_decay=p.weight_decay, fused=flag)
