"""How many torch threads a CPU training job steps on: one when its step is too small to share
(torch_devices.fit_cpu_threads, by counting the step's operations); otherwise whichever of one thread
or all of the job's is faster, timed on the job's own model and a batch of its data before training.

Timed because the count that wins depends on what else has the cores: on an idle machine a large
step is faster split over two threads, while a thread that shares its core with another process
stalls every parallel op behind it (seen here: cifar_net at batch 64 on a machine loaded with other
work, 26x slower on two threads than on one). A deterministic job keeps the counted choice, so that
two runs of it step on the same count."""
import copy
import math
import time
from typing import Any

import torch
from torch import nn

from trainyard.worker import torch_devices

PROBE_ROWS = 256  # the probe's batch: the job's batch_size, at most this many samples
PROBE_ROUNDS = 3  # each count times a forward and backward this many times (the first a warm-up)


def fit(model: nn.Module, x: torch.Tensor, batch_size: int, device: torch.device, applied: dict[str, Any],
        deterministic: bool) -> None:
    """Set torch's thread count for training model on batches like x's rows; reported as applied["cpu_threads"]."""
    torch_devices.fit_cpu_threads(model, x[:1], batch_size, device, applied)
    threads = applied.get("cpu_threads")
    if device.type != "cpu" or threads is None or threads == 1 or deterministic:
        return
    best = fastest(model, x[:min(batch_size, PROBE_ROWS)], [threads, 1])
    torch.set_num_threads(best)
    applied["cpu_threads"] = best


def fastest(model: nn.Module, x: torch.Tensor, counts: list[int]) -> int:
    """The thread count of counts under which a forward and backward of x through (a copy of) model is
    fastest, rounds interleaved, each count's best round. Nothing of model or the random streams changes."""
    shadow = copy.deepcopy(model).train()
    best = dict.fromkeys(counts, math.inf)
    with torch.random.fork_rng(devices=[]):
        for r in range(PROBE_ROUNDS):
            for n in counts:
                if best[n] > 2 * min(best.values()):  # clearly the slower: no more rounds of it
                    continue
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                shadow(x).float().sum().backward()
                if r:
                    best[n] = min(best[n], time.perf_counter() - t0)
                shadow.zero_grad(set_to_none=True)
    return min(counts, key=lambda n: best[n])
