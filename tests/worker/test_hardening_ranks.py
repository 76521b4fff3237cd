"""What other ranks send rank 0 is JSON in tensors, never a pickle: a rogue process that joins a job's
rendezvous (TCPStore has no authentication) and speaks torch's gather_object cannot run code on rank 0's
host; it is refused. Two real CPU processes over gloo meet at a TCPStore on 127.0.0.1 through the
product's own distributed.init, and take rounds: rank 0 always calls the product's gather, rank 1 plays
a rank or the rogue."""
import builtins
import multiprocessing as mp
import queue
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.service import free_port
from trainyard.worker import distributed, train_checkpoint
from trainyard.worker.errors import RankMessageRefused

PAYLOAD = {"metric": 0.25, "names": ["a", "é"], "flag": True, "none": None, "nested": {"epoch": [1, 2]}}


class Rogue:
    """Unpickling this writes a marker file: what a rogue rank would send to run code on rank 0."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return builtins.exec, (f"open({self.marker!r}, 'w').write('ran on rank 0')",)


def rank_main(rank: int, master: str, marker: str, results: Any) -> None:
    """Rank 0 calls the product's gather every round and reports what came of it; rank 1 sends."""
    import torch.distributed as dist
    distributed.TIMEOUT = timedelta(seconds=30)  # a round that hangs fails the test, not after 10 minutes
    world = distributed.World(rank, 2)
    distributed.init(world, torch.device("cpu"), Path(marker).parent / "store", master=master, rendezvous_s=30)

    def product_round(obj: Any) -> None:
        try:
            got = distributed.gather(obj, world)
            if rank == 0:
                results.put(("ok", got))
        except RankMessageRefused as exc:
            results.put(("refused", str(exc)))

    # 1: two honest ranks; the same results as before (rank order, JSON values), and None off rank 0.
    product_round({**PAYLOAD, "rank": rank})
    if rank == 1:
        results.put(("rank 1 got", distributed.gather("again", world)))
    else:
        product_round("rank 0")
    # 2: the rogue speaks the old wire, a pickle whose loading runs code.
    if rank == 1:
        dist.gather_object(Rogue(marker), None, dst=0, group=world.control)
    else:
        product_round({"rank": 0})
    # 3: the rogue announces a message of a terabyte; rank 0 refuses it before setting anything aside.
    if rank == 1:
        dist.all_gather([torch.zeros(1, dtype=torch.int64) for _ in range(2)],
                        torch.tensor([1 << 40], dtype=torch.int64), group=world.control)
    else:
        product_round({"rank": 0})
    results.put(("finished", rank))


@pytest.fixture(scope="module")
def rounds(tmp_path_factory) -> tuple[list[tuple[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("ranks")
    marker = tmp / "pwned"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    master = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=rank_main, args=(r, master, str(marker), results)) for r in (0, 1)]
    for p in procs:
        p.start()
    got: list[tuple[str, Any]] = []
    try:
        while sum(1 for kind, _ in got if kind == "finished") < 2:
            got.append(results.get(timeout=60))
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return got, marker


def test_honest_ranks_results_reach_rank_0_as_before_in_rank_order(rounds):
    got, _ = rounds
    assert got[0] == ("ok", [{**PAYLOAD, "rank": r} for r in (0, 1)]), got
    assert ("ok", ["rank 0", "again"]) in got and ("rank 1 got", None) in got, got


def test_a_rank_speaking_pickle_is_refused_and_rank_0_never_runs_it(rounds):
    got, marker = rounds
    assert not marker.exists(), "rank 0 unpickled a peer's message and ran its code"
    refusals = [m for kind, m in got if kind == "refused"]
    assert refusals and "rank 1 sent rank 0" in refusals[0] and "not JSON" in refusals[0], got


def test_a_rank_announcing_a_huge_message_is_refused_before_rank_0_allocates_it(rounds):
    got, _ = rounds
    refusals = [m for kind, m in got if kind == "refused"]
    assert len(refusals) == 2 and f"rank 1 would send rank 0 {1 << 40} bytes" in refusals[1], got
    assert ("finished", 0) in got, got  # rank 0 went on: refused, not crashed or waiting


def test_one_rank_gathers_json_values_too_and_random_states_survive_the_trip():
    # A tuple arrives a list, as JSON has it: on one device as on many.
    assert distributed.gather({"pair": (1, 2)}, distributed.World()) == [{"pair": [1, 2]}]
    with pytest.raises(TypeError):  # a value JSON cannot carry fails on one device as on many
        distributed.gather({"state": torch.zeros(1)}, distributed.World())
    state = torch.get_rng_state()
    [back] = train_checkpoint._rank_states([{"torch_rng": train_checkpoint._text(state), "cuda_rng": None}])
    assert torch.equal(back["torch_rng"], state) and back["torch_rng"].dtype == torch.uint8
    assert back["cuda_rng"] is None
    with pytest.raises(RankMessageRefused):
        train_checkpoint._rank_states([{"torch_rng": "not base64!", "cuda_rng": None}])
