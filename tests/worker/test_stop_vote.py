"""The ranks' stop vote (worker/stop_vote.py): every rank stops at the same call, at any pace of any
rank, a stop asked for is acted on within about two votes, and a fast loop votes seldom, not at each
step (voting at every step woke gloo's threads ~800 times a second on each host of a job across hosts)."""
import multiprocessing as mp
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from trainyard.worker.stop_vote import MAX_SKIP

CALLS = 5000  # room for a stop asked at call 2,000 in a loop voting every MAX_SKIP (1,000) calls: two votes


def _rank(rank: int, store_path: str, every_s: float, sleeps: tuple[float, float], stop_at: int, out) -> None:
    import torch.distributed as dist

    from trainyard.worker import stop_vote
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    votes = 0
    real = stop_vote.dist.all_reduce

    def counted(*args, **kwargs):
        nonlocal votes
        votes += 1
        return real(*args, **kwargs)
    stop_vote.dist.all_reduce = counted
    world: Any = SimpleNamespace(size=2, rank=rank, control=dist.group.WORLD)  # what the vote reads of a World
    vote = stop_vote.StopVote(world, every_s=every_s)
    asked_at = None
    for call in range(CALLS):
        if call == stop_at:
            asked_at = time.monotonic()
        if vote(rank == 0 and call >= stop_at):
            out.put((rank, call, votes, time.monotonic() - asked_at if asked_at else None))
            break
        time.sleep(sleeps[rank])
    else:
        out.put((rank, None, votes, None))
    dist.destroy_process_group()


def run_ranks(tmp_path, every_s: float, sleeps: tuple[float, float], stop_at: int) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), every_s, sleeps, stop_at, out))
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, *rest = out.get(timeout=90)
            results[rank] = tuple(rest)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results


def test_a_fast_loop_votes_seldom_and_every_rank_stops_at_the_same_call(tmp_path):
    # Calls take microseconds here: voting about every 50 ms is one vote in hundreds of calls, at most MAX_SKIP.
    results = run_ranks(tmp_path, every_s=0.05, sleeps=(0.0, 0.0), stop_at=2000)
    (call0, votes0, _), (call1, votes1, _) = results[0], results[1]
    assert call0 is not None and call0 == call1, results
    assert 2000 < call0 <= 2000 + 2 * MAX_SKIP and votes0 == votes1
    assert votes0 < CALLS / 10, f"{votes0} votes in {call0} calls: the loop votes too often"


@pytest.mark.parametrize("sleeps", [(0.0, 0.002), (0.002, 0.0)], ids=["rank 1 slow", "rank 0 slow"])
def test_ranks_at_different_paces_agree_and_a_stop_lands_within_about_two_votes(tmp_path, sleeps):
    # The slower rank's proposal (fewer calls between votes) holds for both: one rank's calls never
    # outrun the other's votes, so no vote waits long and the stop still lands within ~2 x every_s.
    results = run_ranks(tmp_path, every_s=0.05, sleeps=sleeps, stop_at=200)
    (call0, votes0, took0), (call1, votes1, _) = results[0], results[1]
    assert call0 is not None and call0 == call1 and votes0 == votes1, results
    assert 200 < call0 and took0 < 2 * 0.05 + 0.1, results
    assert votes0 < call0 / 5, results  # 2 ms a call: a vote about every 25 calls, not every call


def test_one_rank_is_its_own_flag():
    from trainyard.worker.stop_vote import StopVote
    world: Any = SimpleNamespace(size=1, rank=0, control=None)
    vote = StopVote(world)
    assert vote(False) is False and vote(True) is True
