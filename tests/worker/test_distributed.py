"""Jobs on several devices: two CPU ranks over gloo take the same steps as one process with their
whole batch; a stopped multi-rank job resumes exactly; a rank that dies ends the job, leaving no rank."""
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.jobs import tiny_job
from tests.helpers.processes import gone
from tests.helpers.runner import TERMINAL, JobProcess, plan_for
from tests.helpers.service import free_port
from trainyard.worker import distributed, runner
from trainyard.worker.errors import RendezvousFailed
from trainyard.worker.supervisor.plan import JobPlan


def run_plan(plan: JobPlan) -> tuple[dict, list[dict]]:
    p = JobProcess(plan)
    final = p.finish()
    return final, p.events


def epochs_of(events) -> list[dict]:
    return [e for e in events if e["type"] == "epoch"]


# How the loop fits a model, on two ranks as on one: accumulation groups, clipping, a schedule, the best
# epoch kept and early stopping decided by rank 0 for both.
FITTING = {"accumulate_steps": 2, "grad_clip_norm": 0.5, "lr_schedule": {"name": "cosine", "warmup_epochs": 1},
           "keep": "best", "early_stopping": {"metric": "val_accuracy", "patience": 2, "min_delta": 1.0}}


@pytest.mark.slow  # 10-20 s of two ranks' real training per case: the full suite's
@pytest.mark.parametrize("per_rank,val_fraction,fitting", [
    (16, 0.2, {}),   # 120 samples: three global batches of 32, then one of 24 (12 per rank)
    (52, 0.3, {}),   # 105 samples: a global batch of 104, then one sample: rank 1 has none and steps with scale 0
    (16, 0.2, FITTING),  # stops early at epoch 3
])
def test_two_ranks_with_batch_b_match_one_process_with_batch_2b(tmp_path, per_rank, val_fraction, fitting):
    base = tiny_job(epochs=4, lr=0.05, optimizer="adam", **fitting)
    base["model"] = {"arch": "mlp", "hidden": [16, 16]}
    base["data"]["val_fraction"] = val_fraction
    one = {**base, "train": {**base["train"], "batch_size": 2 * per_rank}}
    two = {**base, "train": {**base["train"], "batch_size": per_rank}, "devices": 2}

    single, single_events = run_plan(plan_for(tmp_path, one, name="one"))
    double, double_events = run_plan(plan_for(tmp_path, two, ranks=("cpu", "cpu"), name="two"))
    assert single["type"] == double["type"] == "done", (single, double)
    assert double["result"]["devices"] == 2 and single["result"]["devices"] == 1

    a, b = epochs_of(single_events), epochs_of(double_events)
    assert [e["epoch"] for e in b] == ([1, 2, 3] if fitting else [1, 2, 3, 4])  # rank 0 alone reports
    assert double["result"]["stopped_early_at"] == single["result"]["stopped_early_at"]
    for x, y in zip(a, b):
        assert y["train_loss"] == pytest.approx(x["train_loss"], rel=1e-5, abs=1e-6)
        assert y["val_loss"] == pytest.approx(x["val_loss"], rel=1e-5, abs=1e-6)
    w1 = load_file(tmp_path / "one" / "art" / "model.safetensors")
    w2 = load_file(tmp_path / "two" / "art" / "model.safetensors")
    assert w1.keys() == w2.keys()  # a plain model's state_dict: no "module." prefix
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6)
    # And the steps really moved the weights: the comparison is not between two untouched models.
    assert a[-1]["train_loss"] < a[0]["train_loss"]


@pytest.mark.slow  # 10-20 s of two ranks' real training: the full suite's
def test_a_stopped_two_rank_job_checkpoints_and_resumes_exactly(tmp_path):
    spec = {**tiny_job(epochs=30, lr=0.01, batch_size=8), "devices": 2}
    spec["model"] = {"arch": "mlp", "hidden": [32], "dropout": 0.2}  # dropout: each rank's RNG matters
    whole, whole_events = run_plan(plan_for(tmp_path, spec, ranks=("cpu", "cpu"), name="whole"))
    assert whole["type"] == "done"

    first = JobProcess(plan_for(tmp_path, spec, ranks=("cpu", "cpu"), name="first"))
    first.until(("epoch",))
    os.kill(first.proc.pid, signal.SIGTERM)  # as the supervisor stops a job on shutdown: rank 0 only
    ck = first.until(("checkpoint",))
    assert first.finish()["type"] == "preempted"
    assert all(gone(pid) for pid in first.rank_pids())

    resumed, resumed_events = run_plan(plan_for(tmp_path, spec, ranks=("cpu", "cpu"), name="second",
                                                resume_from=type(tmp_path)(ck["path"])))
    assert resumed["type"] == "done" and resumed["result"]["resumed_from_epoch"] == ck["epoch"]
    # Same weights as the run that was never stopped: every rank's RNG and position came back.
    w1 = load_file(tmp_path / "whole" / "art" / "model.safetensors")
    w2 = load_file(tmp_path / "second" / "art" / "model.safetensors")
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=0)
    last = {e["epoch"]: e["train_loss"] for e in epochs_of(whole_events)}
    for e in epochs_of(resumed_events):
        if e["epoch"] > ck["epoch"] + 1:  # a mid-epoch resume's first epoch reports only its own part's time
            assert e["train_loss"] == pytest.approx(last[e["epoch"]], abs=0)


@pytest.mark.slow  # 5-6 s of two ranks: the full suite's, not the quick loop's
def test_a_rank_that_dies_ends_the_job_and_no_rank_is_left(tmp_path):
    spec = {**tiny_job(epochs=10000, batch_size=8), "devices": 2}
    p = JobProcess(plan_for(tmp_path, spec, ranks=("cpu", "cpu")))
    p.until(("epoch",))
    [rank1] = p.rank_pids()
    os.kill(rank1, signal.SIGKILL)
    final = p.finish(timeout=30)
    assert final["type"] == "error" and final["error"]["class"] == "infrastructure", final
    assert "rank 1" in final["error"]["message"] and "signal 9" in final["error"]["message"]
    assert not p.proc.is_alive()


@pytest.mark.slow  # 5-6 s of two ranks: the full suite's, not the quick loop's
def test_killing_rank_0_takes_the_other_ranks_with_it(tmp_path):
    spec = {**tiny_job(epochs=10000, batch_size=8), "devices": 3}
    p = JobProcess(plan_for(tmp_path, spec, ranks=("cpu", "cpu", "cpu")))
    p.until(("epoch",))
    pids = p.rank_pids()
    assert len(pids) == 2
    os.kill(p.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(pid) for pid in pids)


@pytest.mark.slow  # 10-20 s of two ranks' real training: the full suite's
def test_ranks_meeting_at_rank_0s_address_take_the_same_steps_as_through_the_file_store(tmp_path):
    """The rendezvous of ranks on several hosts (torch's TCPStore at rank 0's address), here on one: the
    same collectives, so the same weights to the last bit."""
    spec = {**tiny_job(epochs=3, lr=0.05, batch_size=16), "devices": 2}
    spec["model"] = {"arch": "mlp", "hidden": [16]}
    filed, _ = run_plan(plan_for(tmp_path, spec, ranks=("cpu", "cpu"), name="file"))
    tcp, _ = run_plan(plan_for(tmp_path, spec, ranks=("cpu", "cpu"), name="tcp", master=f"127.0.0.1:{free_port()}"))
    assert filed["type"] == tcp["type"] == "done", (filed, tcp)
    assert not (tmp_path / "tcp" / "ck" / "run-1.pt.ranks").exists()  # no file store: they met over TCP
    w1 = load_file(tmp_path / "file" / "art" / "model.safetensors")
    w2 = load_file(tmp_path / "tcp" / "art" / "model.safetensors")
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=0)


@pytest.mark.slow  # 10-20 s of two ranks' real training: the full suite's
def test_a_job_split_over_two_job_processes_as_over_two_hosts_takes_the_same_steps(tmp_path):
    """Each host runs its own ranks in a job process of its own (local_ranks), meeting at rank 0's address:
    the same collectives as one process forking both ranks, so the same weights to the last bit; the other
    host's job process ends with "done" and writes no model."""
    spec = {**tiny_job(epochs=3, lr=0.05, batch_size=16), "devices": 4, "hosts": 2}
    spec["model"] = {"arch": "mlp", "hidden": [16], "dropout": 0.1}
    ranks = ("cpu",) * 4
    whole, _ = run_plan(plan_for(tmp_path, spec, ranks=ranks, name="whole"))
    master = f"127.0.0.1:{free_port()}"
    first = JobProcess(plan_for(tmp_path, spec, ranks=ranks, name="a", master=master, local=(0, 1)))
    second = JobProcess(plan_for(tmp_path, spec, ranks=ranks, name="b", master=master, local=(2, 3)))
    a, b = first.finish(), second.finish()
    assert whole["type"] == a["type"] == b["type"] == "done", (a, b)
    assert not epochs_of(second.events) and len(second.rank_pids()) == 1  # rank 3, forked by rank 2's process
    assert not (tmp_path / "b" / "art" / "model.safetensors").exists()
    w1 = load_file(tmp_path / "whole" / "art" / "model.safetensors")
    w2 = load_file(tmp_path / "a" / "art" / "model.safetensors")
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=0)


@pytest.mark.slow  # 10-20 s of two ranks' real training: the full suite's
def test_a_host_whose_ranks_vanish_fails_the_others_as_infrastructure_not_at_the_collective_timeout(tmp_path):
    spec = {**tiny_job(epochs=10000, batch_size=8), "devices": 2, "hosts": 2}
    master = f"127.0.0.1:{free_port()}"
    first = JobProcess(plan_for(tmp_path, spec, ranks=("cpu", "cpu"), name="a", master=master, local=(0,)))
    second = JobProcess(plan_for(tmp_path, spec, ranks=("cpu", "cpu"), name="b", master=master, local=(1,)))
    first.until(("epoch",))
    os.kill(second.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    final = first.finish(timeout=60)
    assert final["type"] == "error" and final["error"]["class"] == "infrastructure", final
    assert final["error"]["type"] == "RankLost" and "rank 0 lost its link" in final["error"]["message"], final
    assert time.monotonic() - t0 < distributed.REASON_WAIT_S + 10


@pytest.mark.slow  # 5-6 s of two ranks: the full suite's, not the quick loop's
def test_a_rendezvous_address_that_is_not_rank_0s_fails_the_run_as_infrastructure_naming_it(tmp_path):
    spec = {**tiny_job(epochs=3, batch_size=16), "devices": 2}
    master = f"192.0.2.1:{free_port()}"  # TEST-NET-1: no host here has it, nothing answers there
    final, _ = run_plan(plan_for(tmp_path, spec, ranks=("cpu", "cpu"), master=master))
    assert final["type"] == "error" and final["error"]["class"] == "infrastructure", final
    assert final["error"]["type"] == "RendezvousFailed" and master in final["error"]["message"], final


def test_a_rank_that_cannot_reach_rank_0_gives_up_at_the_rendezvous_limit_naming_the_address():
    t0 = time.monotonic()
    with pytest.raises(RendezvousFailed, match=r"rank 1 of 2 could not reach the job's rendezvous at "
                                               r"192\.0\.2\.1:29999 within 1 s"):
        distributed.tcp_store(distributed.World(1, 2), "192.0.2.1:29999", rendezvous_s=1)
    assert time.monotonic() - t0 < 15  # the limit, not the collectives' ten minutes


def test_shard_splits_a_global_batch_so_the_mean_gradient_is_the_whole_batch_s():
    idx = torch.arange(7)
    parts = [distributed.shard(idx, distributed.World(r, 3)) for r in range(3)]
    assert [p[0].tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    # DDP averages over 3 ranks: sum(scale_r * mean_r) / 3 == sum over all 7 / 7
    assert sum(p[2] for p in parts) / 3 == pytest.approx(1.0)
    assert [p[1] for p in parts] == [3, 2, 2]
    empty = distributed.shard(torch.arange(1), distributed.World(1, 2))
    assert empty[1] == 0 and empty[2] == 0.0 and empty[0].tolist() == [0]


def _job_counting_allreduces(plan: JobPlan, conn, counts) -> None:
    """The job process, with a DDP comm hook on the model each rank trains that counts its gradient
    all-reduces (one line per bucket reduced) in counts/rank-N, then reduces as DDP does."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from trainyard.worker import train
    real_build = train.build

    def build(spec, ctx):
        run = real_build(spec, ctx)
        path = counts / f"rank-{ctx.world.rank}"

        def hook(state, bucket):
            with open(path, "a") as f:
                f.write("1\n")
            return default_hooks.allreduce_hook(state, bucket)
        run.forward.register_comm_hook(None, hook)  # forward: the DDP model (not compiled here)
        return run
    train.build = build
    runner.run(plan, conn)


@pytest.mark.slow  # a job process and its second rank: ~8 s, more on a loaded machine
def test_accumulation_all_reduces_once_per_optimizer_step(tmp_path):
    # 120 samples, 10 per rank on 2 ranks: 6 batches an epoch, 3 per optimizer step: 2 steps, 4 in 2 epochs.
    # Without no_sync() DDP all-reduced after every batch: 12. The model fits DDP's one bucket.
    spec = {**tiny_job(epochs=2, batch_size=10, accumulate_steps=3), "devices": 2}
    counts = tmp_path / "counts"
    counts.mkdir()
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_job_counting_allreduces, args=(plan_for(tmp_path, spec, ranks=("cpu", "cpu")),
                                                               child, counts))
    proc.start()
    child.close()
    events = []
    while not events or events[-1]["type"] not in TERMINAL:
        assert conn.poll(120), events
        events.append(conn.recv())
    proc.join(30)
    assert events[-1]["type"] == "done", events[-1]
    for rank in (0, 1):
        assert len((counts / f"rank-{rank}").read_text().split()) == 4, rank


def test_ranks_across_hosts_use_the_interface_that_holds_their_hosts_address(monkeypatch):
    assert distributed.interface_of("127.0.0.1") == "lo"
    assert distributed.interface_of("192.0.2.1") is None and distributed.interface_of("box.example") is None
    # setenv first, so that monkeypatch restores its absence: use_interface sets it in this very process, and
    # left set it would reach every later test's processes (a job across namespaces then binds to loopback).
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # set by hand: kept
    distributed.use_interface("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo" and os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
