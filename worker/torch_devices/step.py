"""How a training step runs: compiled (or eager when torch.compile fails, saying why), on one CPU thread
when it is too small to share, warmed up on a batch shaped as training hands it to the model.
"""
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
from torch import nn

from trainyard.worker.torch_devices.device import cuda_rng_state, set_cuda_rng_state

# A CPU training step under this many floating-point operations (forward and backward) runs on one
# thread: its ops are too small to split, and waking the other threads for each of them costs more
# than they save, most of all while the worker's supervisor or another process has those cores
# (bench: iris 1.2x, cifar_net at batch 4 1.16x faster on one thread of two; at batch 64, 205 MFLOP
# a step, 1.4x faster on two).
SMALL_STEP_FLOPS = 50e6


def step_flops(model: nn.Module, sample: torch.Tensor, batch_size: int) -> int:
    """Floating-point operations of one training step's forward and backward, counted on a copy of the
    model on the meta device (nothing computed, nothing of the real model touched) for one sample in
    eval mode, and scaled to the batch."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode
    shadow = copy.deepcopy(model).to("meta").eval()
    with FlopCounterMode(display=False) as counter:
        shadow(sample[:1].to("meta")).float().sum().backward()
    return counter.get_total_flops() * batch_size


def fit_cpu_threads(model: nn.Module, sample: torch.Tensor, batch_size: int, device: torch.device,
                    applied: dict[str, Any]) -> None:
    """One thread for a CPU job whose steps are too small to share (SMALL_STEP_FLOPS); reported in applied."""
    if device.type != "cpu":
        return
    threads = torch.get_num_threads()
    if threads > 1:
        try:
            small = step_flops(model, sample, batch_size) < SMALL_STEP_FLOPS
        except Exception:
            small = False
        if small:
            torch.set_num_threads(threads := 1)
    applied["cpu_threads"] = threads


def warm_up_batch(x: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    """A batch as the training loop hands it to the model: on the device (a dataset kept in host memory
    is copied per batch) and in channels_last when the job runs in it."""
    x = x.to(device)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def compile_model(model: nn.Module, wanted: bool, example: torch.Tensor, applied: dict[str, Any],
                  autocast: Callable[[], AbstractContextManager] = nullcontext) -> nn.Module:
    """torch.compile the model, or return it unchanged (eager) if compiling fails, saying why.

    Compilation is lazy, so one forward on `example` (warm_up_batch()) forces it here, where a missing
    toolchain can still be turned into a fallback rather than a failed job. The forward runs as
    training will (train mode, autograd on, under the job's autocast), so the graph compiled here is the
    one training uses (a warm-up outside autocast would compile an fp32 graph that a bf16 or fp16 job never
    runs, and training would compile again, unguarded by the fallback below); it
    leaves no trace: BatchNorm's running statistics and the random streams (dropout) are put back, so
    a compiled run draws what an eager one does. applied["compile"]: "on" (the compiled warm-up ran),
    "off" (not asked) or "fell back to eager" (with the reason in applied["compile_error"]).
    """
    applied["compile"] = "off"
    if not wanted:
        return model
    was_training = model.training
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    rng, device_rng = torch.get_rng_state(), cuda_rng_state(example.device)
    try:
        # torch.compile of a module returns an OptimizedModule (a Module); its type hints say only Callable.
        compiled = cast(nn.Module, torch.compile(model))
        model.train()
        # DDP: no gradient sync is prepared for a backward that never comes.
        with (model.no_sync() if isinstance(model, nn.parallel.DistributedDataParallel) else nullcontext()), \
                autocast():
            compiled(example)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        applied["compile"] = "fell back to eager"
        applied["compile_error"] = f"{type(e).__name__}: {first_line}"
        applied["notes"].append(f"torch.compile failed ({type(e).__name__}: {first_line}); ran eager")
        return model
    finally:
        model.train(was_training)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        torch.set_rng_state(rng)
        set_cuda_rng_state(example.device, device_rng)
    applied["compile"] = "on"
    return compiled

