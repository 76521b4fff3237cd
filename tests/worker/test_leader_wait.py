"""Rank 0's long work alone does not fail a job on several devices (issue 39, finding 4): real job processes on
the CPU, their collectives' timeout set to a few seconds (TRAINYARD_COLLECTIVE_TIMEOUT_S), and rank 0 working
alone for longer than that: uploading a checkpoint to a slow bucket (a train job; a run job's ctx.checkpoint)
or evaluating a model that is slow to evaluate. The other ranks wait for it by the store and the job succeeds;
before, they waited in the next collective and were failed at its timeout. Cancelling such a job while rank 0
works still stops every one of its processes within seconds; rank 0 dying while the others wait for it by a
TCPStore (ranks across hosts) fails them at once, as a broken link."""
import dataclasses
import multiprocessing as mp
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.processes import gone
from tests.helpers.runner import JobProcess, plan_for
from tests.helpers.service import Service, free_port, probe_plugin

pytestmark = pytest.mark.slow  # job processes with two ranks, each waiting out seconds on purpose

TIMEOUT_S = 6  # the collectives' timeout in these tests (rank skew on a loaded machine stays well under it)
HOLD_S = TIMEOUT_S + 4  # rank 0's work alone: longer than a collective would wait for it

PLUGIN = '''
import time

import torch
from torch import nn


def slow_to_evaluate(input_shape, num_classes, seconds=7.0):
    return SlowToEvaluate(input_shape, num_classes, seconds)


class SlowToEvaluate(nn.Module):
    """A linear model whose evaluation takes `seconds`: only rank 0 evaluates."""

    def __init__(self, input_shape, num_classes, seconds):
        super().__init__()
        self.seconds = seconds
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), num_classes))

    def forward(self, x):
        if not self.training and len(x) > 2:  # two samples: the shape probe every rank runs at its start
            print("evaluating slowly", flush=True)
            time.sleep(self.seconds)
        return self.net(x)


def checkpoints_each_epoch(ctx, config):
    model = ctx.parallel(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(1, config["epochs"] + 1):
        optimizer.zero_grad()
        loss = model(torch.ones(8, 4) * epoch).square().mean()
        loss.backward()  # DDP's all-reduce: the collective that waited for rank 0's upload
        optimizer.step()
        ctx.report(epoch, loss=loss.item())
        ctx.checkpoint({"epoch": epoch, "model": model.module.state_dict()})
    return {"loss": loss.item()}
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> Path:
    root = probe_plugin(tmp_path_factory.mktemp("slow_rank_0"), "trainyard_slow_rank_0", PLUGIN,
                        ("checkpoints_each_epoch",))
    with open(root / "trainyard_slow_rank_0-0.1.dist-info" / "entry_points.txt", "a") as f:
        f.write("[trainyard.models]\nslow_to_evaluate = trainyard_slow_rank_0:slow_to_evaluate\n")
    return root


@pytest.fixture
def short_timeout(monkeypatch, plugin):
    """Job processes started from here time their collectives out after TIMEOUT_S and find the plugin."""
    monkeypatch.setenv("TRAINYARD_COLLECTIVE_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.syspath_prepend(str(plugin))  # a spawned job process starts with this sys.path


class SlowBucket:
    """A TCP relay in front of the tests' S3 server that holds each upload of an epoch-1 checkpoint for `hold`
    seconds before passing it on: a slow bucket (a far region, a loaded MinIO)."""

    def __init__(self, endpoint: str, hold: float):
        host, port = endpoint.removeprefix("http://").rsplit(":", 1)
        self.upstream, self.hold, self.held = (host, int(port)), hold, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                line = chunk.split(b"\r\n", 1)[0]
                if requests and line.startswith(b"PUT ") and b"-e00001-s" in line:
                    self.held += 1
                    time.sleep(self.hold)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture
def slow_bucket(bucket, monkeypatch):
    """The test's bucket behind a SlowBucket: job processes started from here upload through it."""
    relay = SlowBucket(bucket.env["AWS_ENDPOINT_URL_S3"], HOLD_S)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", relay.url)
    yield bucket, relay
    relay.listener.close()


def train_job(**train) -> dict:
    return {"kind": "train", "model": {"arch": "mlp", "hidden": [8]}, "data": {"dataset": "iris"},
            "train": {"epochs": 2, "batch_size": 16, "checkpoint_every_s": 0, **train}, "device": "cpu",
            "devices": 2}


@pytest.mark.parametrize("spec", [
    train_job(),  # checkpoints after epoch 1 (train_checkpoint.checkpoint)
    {"kind": "run", "entrypoint": "checkpoints_each_epoch", "config": {"epochs": 2}, "device": "cpu",
     "devices": 2},  # ctx.checkpoint on every rank
], ids=["train", "run"])
def test_a_checkpoint_uploaded_to_a_slow_bucket_for_longer_than_the_collective_timeout_fails_no_rank(
        tmp_path, short_timeout, slow_bucket, spec):
    bucket, relay = slow_bucket
    plan = dataclasses.replace(plan_for(tmp_path, spec, ranks=("cpu", "cpu")), storage_url=bucket.url)
    started = time.monotonic()
    final = JobProcess(plan).finish(timeout=120)
    assert final["type"] == "done", final.get("error", final)
    assert relay.held == 1 and time.monotonic() - started > HOLD_S  # rank 0 did upload for longer than the timeout
    assert any(re.search(r"/ck/run-1-e00001-s\d+\.pt$", key) for key in bucket.keys()), bucket.keys()


def test_an_evaluation_longer_than_the_collective_timeout_fails_no_rank(tmp_path, short_timeout):
    spec = {**train_job(epochs=2), "model": {"arch": "slow_to_evaluate", "params": {"seconds": HOLD_S}}}
    p = JobProcess(plan_for(tmp_path, spec, ranks=("cpu", "cpu")))
    final = p.finish(timeout=120)
    assert final["type"] == "done", final.get("error", final)
    epochs = [e for e in p.events if e["type"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2] and all("val_loss" in e for e in epochs)
    assert all(gone(pid) for pid in p.rank_pids())


def test_rank_0_dying_while_the_others_wait_by_its_tcp_store_fails_them_at_once_as_a_broken_link(tmp_path):
    """Across hosts the store is rank 0's TCPStore: the wait has no deadline, yet ends when rank 0's process does."""
    master, ready = f"127.0.0.1:{free_port()}", tmp_path / "rank-0-at-work"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_wait_for_rank_0, args=(r, master, ready, results)) for r in (0, 1)]
    for r in ranks:
        r.start()
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline and ranks[0].is_alive(), "rank 0 never began its work"
        time.sleep(0.05)
    time.sleep(1)  # rank 1 waits by the store now
    ranks[0].kill()
    killed = time.monotonic()
    rank, broken, what = results.get(timeout=30)
    assert rank == 1 and broken, what
    assert time.monotonic() - killed < 10
    ranks[1].join(10)


def _wait_for_rank_0(rank: int, master: str, ready: Path, results) -> None:
    import torch

    from trainyard.worker import broken_links, distributed
    from trainyard.worker.leader_wait import leader_alone
    world = distributed.World(rank, 2)
    distributed.init(world, torch.device("cpu"), ready.with_name("unused"), master)
    try:
        with leader_alone(world, "work"):
            if world.leader:
                ready.touch()
                time.sleep(600)  # killed here
        results.put((rank, False, "passed the section with rank 0 gone"))
    except Exception as exc:
        results.put((rank, broken_links.is_broken_link(exc), f"{type(exc).__name__}: {exc}"))


def test_cancelling_a_job_while_rank_0_evaluates_stops_every_rank_at_once(tmp_path, plugin):
    """The other ranks wait for rank 0 by the store with no deadline: a cancel still ends every process of the
    job within seconds, and before that, past the collectives' timeout, the job is still running."""
    svc = Service(tmp_path / "data")
    try:
        svc.start_server()
        env = {"PYTHONPATH": str(plugin), "TRAINYARD_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S)}
        for _ in range(2):
            svc.start_worker("cpu", env=env)
        job = svc.submit({**train_job(epochs=3), "model": {"arch": "slow_to_evaluate", "params": {"seconds": 600}}})
        with svc.client() as c:
            def log() -> str:
                return c.get(f"/jobs/{job['id']}/logs").text
            svc.wait_until(lambda: "evaluating slowly" in log(), 120, "rank 0 to begin evaluating")
            time.sleep(TIMEOUT_S + 2)  # the other rank's collective would have timed out by now
            assert svc.job(job["id"])["state"] == "running" and svc.job(job["id"])["runs"] == 1
            pids = [int(p) for p in re.findall(r"(?:rank \d+|job process) pid (\d+)", log())]
            assert len(pids) == 2, log()
            assert c.post(f"/jobs/{job['id']}/cancel").status_code == 200
        cancelled = time.monotonic()
        while not all(gone(p) for p in pids) and time.monotonic() - cancelled < 10:
            time.sleep(0.05)
        assert all(gone(p) for p in pids), [p for p in pids if not gone(p)]
        assert svc.wait_state(job["id"], timeout=30)["state"] == "cancelled"
    finally:
        svc.stop()
