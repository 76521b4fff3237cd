"""Rank 0's work alone (evaluating, writing and uploading a checkpoint, saving the model), and how the other
ranks of a job on several devices wait for it: by the store the ranks met through, not in a collective.

A collective gives up after the process group's timeout (distributed.TIMEOUT, ten minutes): a rank that went
on to the next all-reduce while rank 0 evaluated a large validation set, or uploaded a checkpoint to a slow
bucket, was failed there with rank 0 healthy and at work. So every rank passes the section together: rank 0
does the work, then sets the section's key in the store; the others poll that key, with short sleeps and no
deadline, and only then go on to the next collective, which finds every rank there and completes at once.

No deadline, yet no rank waits for ever: a rank 0 that dies takes its host's other ranks with it
(PR_SET_PDEATHSIG, worker/distributed.py); on another host the store is a TCPStore that rank 0 serves, whose
reads fail once rank 0's process is gone (a broken link: the run is retried as infrastructure); a rank 0 that
hangs is its supervisor's to stop (a cancel, the job's timeout, each host's lease and fence), as any job is.
"""
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from trainyard.worker.distributed import World

# The first poll comes this soon, each next one twice as late up to POLL_MAX_S: a short section costs the
# others about its own length again at most, a long one a check of the store every POLL_MAX_S.
POLL_FIRST_S = 0.001
POLL_MAX_S = 0.05

# How many times this process has passed each section: the key of its next pass. Every rank passes the
# sections in the same order, so rank 0's n-th pass is every rank's n-th. A job process (or a rank forked
# from it) is one rank of one job, so the counts are this process's for its whole life.
_passes: dict[str, int] = {}


@contextmanager
def leader_alone(world: World, tag: str) -> Iterator[None]:
    """Around work rank 0 does alone, entered by every rank at the same point (the block runs on every rank:
    guard the work itself by world.leader): each rank leaves the block once rank 0 has left it, done or
    raising (rank 0's error ends the job and its ranks; one its program catches leaves every rank in step)."""
    if world.size == 1:
        yield
        return
    n = _passes[tag] = _passes.get(tag, 0) + 1
    key = f"trainyard/leader_alone/{tag}/{n}"
    if world.leader:
        try:
            yield
        finally:
            store().set(key, "1")
    else:
        yield
        wait_for(store(), key)


def wait_for(store: dist.Store, key: str) -> None:
    """Return once key is in store, however long that takes; a store that cannot be read any more (rank 0's
    TCPStore, its process gone) raises what torch raises: a DistError, a broken link."""
    pause = POLL_FIRST_S
    while not store.check([key]):
        time.sleep(pause)
        pause = min(pause * 2, POLL_MAX_S)


def store() -> dist.Store:
    """The store this process's ranks met through (distributed.init: the file store, or rank 0's TCPStore)."""
    return dist.distributed_c10d._get_default_store()
