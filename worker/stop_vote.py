"""The training loop's stop vote: how the ranks of a job on several devices agree to stop at one step.

A stop request (the worker shutting down, a preemption) reaches rank 0 only; every rank must stop at
the same step, or one would wait in a gradient all-reduce the others never join. So the ranks vote:
an all-reduce (MAX) of each rank's flag on the job's gloo control group, started in the background
and read at the next vote, so no step waits for it.

A vote costs every rank a round trip and a few wake-ups of gloo's threads. Voting at every step, a job
across two hosts of one core each (bench/hosts.py, 6 ms a step) woke those threads ~800 times a second
per rank and had each rank's main thread pre-empted twice as often as under torchrun, so the ranks vote
about every VOTE_EVERY_S instead: each vote carries each rank's proposal of how many calls to skip
before the next one (what VOTE_EVERY_S holds at its own pace since the last vote), and every rank
reads the same smallest proposal from the same vote, so all of them vote, and stop, at the same call.
A stop asked for is acted on within two votes: at most about 2 x VOTE_EVERY_S and a step.
"""
import time
from typing import Any

import torch
import torch.distributed as dist

from trainyard.worker.distributed import World

VOTE_EVERY_S = 0.1
MAX_SKIP = 1000  # a bound on a proposal: a loop whose steps suddenly slow down still votes soon


class StopVote:
    """Called at the same points on every rank with that rank's stop flag; True on every rank at the
    same call once any rank's flag was set at a vote."""

    def __init__(self, world: World, every_s: float = VOTE_EVERY_S):
        self.world, self.every_s = world, every_s
        self.pending: tuple[Any, torch.Tensor] | None = None
        self.left = 0  # calls to let pass before the next vote
        self.gap = 1  # calls from the last vote to the next: the pace is measured over them
        self.voted_at = time.monotonic()

    def __call__(self, flag: bool) -> bool:
        if self.world.size == 1:
            return flag
        if self.left > 1:
            self.left -= 1
            return False
        decided, skip = False, 1
        if self.pending is not None:
            work, result = self.pending
            work.wait()
            stop, minus_skip = result.tolist()
            decided, skip = stop > 0, max(1, -minus_skip)
        now = time.monotonic()
        # The first vote knows no pace yet (the time since the loop began is not a step's): propose 1.
        proposal = self._proposal(now) if self.pending is not None else 1
        mine = torch.tensor([1 if flag else 0, -proposal], dtype=torch.int32)
        self.pending = (dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.world.control, async_op=True), mine)
        self.left = self.gap = skip
        self.voted_at = now
        return decided

    def _proposal(self, now: float) -> int:
        """How many calls this rank would let pass between votes: VOTE_EVERY_S at its pace since the last."""
        per_call = (now - self.voted_at) / self.gap
        return max(1, min(MAX_SKIP, int(self.every_s / per_call))) if per_call > 0 else MAX_SKIP
