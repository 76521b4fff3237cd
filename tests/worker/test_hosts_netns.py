"""Hosts as separate as this machine can make them: network namespaces of their own, sharing only
PostgreSQL and the S3 server, each reached through the bridge the test makes (app/cli/netns.py).

Ranks on two hosts meet at rank 0's address through torch's own TCPStore and all-reduce over gloo on
the interface GLOO_SOCKET_IFNAME names. A job spread over two hosts takes the same steps as on two
devices of one; a host killed, cut off or a cancel ends every rank on every host within the lease
plus 2 s, and the job resumes from the bucket's checkpoint on the hosts still there. A host whose
network link goes down cannot renew its job's lease: its worker stops the job process when the lease
runs out, though every call it makes to the database hangs, and the job resumes on another host from
the bucket's checkpoint with a gapless history.
"""
import ipaddress
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.processes import alive, job_pids
from tests.helpers.service import FAST_ENV, ROOT, Service, free_port, metrics, probe_plugin, run_job, wait_checkpoint
from trainyard.app.cli.netns import Host, Network, hosts, unavailable
from trainyard.app.launcher import postgres_schema
from trainyard.worker.supervisor import reaper

why_not = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_not is not None, reason=str(why_not))]

LEASE_S = float(FAST_ENV["TRAINYARD_LEASE_S"])
EPOCHS = 30


@dataclass
class Fleet:
    """A server on this machine and CPU workers in hosts of their own, sharing PostgreSQL and a bucket."""
    net: Network
    api: Service
    on_bridge: dict[str, str]
    root: Path
    workers: dict[str, list[subprocess.Popen]] = field(default_factory=dict)

    def start(self, host: Host, **env: str) -> subprocess.Popen:
        w = self.net.start_worker(self.api, host, {**self.on_bridge, "TRAINYARD_DATA_DIR": str(self.root / host.name),
                                                   "TRAINYARD_NODE_ADDR": host.addr, **env})
        self.workers.setdefault(host.name, []).append(w)
        return w

    def host(self, name: str) -> Host:
        return next(h for h in self.net.hosts if h.name == name)

    def job_processes(self, host: Host) -> set[int]:
        """The host's processes other than its workers and their own helpers (the fork server, the resource
        tracker): what jobs started there."""
        ours = {w.pid for w in self.workers.get(host.name, [])}
        return {p for p in host.pids() if p not in ours and reaper.parent_of(p) not in ours}


@contextmanager
def fleet(tmp_path, bucket, count: int) -> Iterator[Fleet]:
    with hosts(count) as net, postgres_schema("spread") as db_url:
        pg = net.forward(5432)
        s3 = net.forward(int(bucket.env["AWS_ENDPOINT_URL_S3"].rsplit(":", 1)[1]))
        api = Service(tmp_path / "api", db_url, env={**bucket.env, "TRAINYARD_STORAGE_URL": bucket.url,
                                                     "TRAINYARD_NODE_NAME": "api"})
        try:
            api.start_server()
            # What a host is told: the database and the bucket at the bridge's address (Fleet.start: a data
            # dir of its own, its address).
            yield Fleet(net, api, {"TRAINYARD_DATABASE_URL": db_url.replace("127.0.0.1:5432", pg),
                                   "AWS_ENDPOINT_URL_S3": f"http://{s3}"}, tmp_path)
        finally:
            api.stop()


def weights(api: Service, job_id: int) -> dict[str, torch.Tensor]:
    with api.client() as c:
        r = c.get(f"/jobs/{job_id}/artifact")
    assert r.status_code == 200, r.text
    return load(r.content)


def across(**over) -> dict:
    return {**slow_job(epochs=EPOCHS), "devices": 2, "hosts": 2, **over}


def running_across(f: Fleet, job_id: int, run: int = 1) -> tuple[Host, Host]:
    """Wait for run `run` of the job to train on two hosts; (rank 0's host, the other)."""
    f.api.wait_until(lambda: f.api.job(job_id)["runs"] == run and (f.api.job(job_id)["checkpoint_epoch"] or 0) >= 1
                     and f.api.job(job_id)["state"] == "running", 120, f"run {run} of job {job_id} to train")
    ranks = f.api.job(job_id)["ranks"]
    assert len({r["host"] for r in ranks}) == 2 and all(r.get("addr") for r in ranks), ranks
    return f.host(ranks[0]["host"]), f.host(ranks[1]["host"])


def gone_within(f: Fleet, host_list, seconds: float, since: float, pids: set[int] | None = None) -> float:
    """Seconds from `since` until no job process is left on any of the hosts, or none of `pids` (a run's, when the
    job may start again there at once) is left (fails past `seconds`)."""
    def left() -> set[int]:
        now = set().union(*(f.job_processes(h) for h in host_list))
        return now if pids is None else {p for p in pids if alive(p)}
    f.api.wait_until(lambda: not left(), seconds - (time.monotonic() - since),
                     "every job process on " + ", ".join(h.name for h in host_list) + " to end")
    return time.monotonic() - since


@pytest.mark.postgres
def test_a_host_cut_off_stops_its_job_within_the_lease_and_the_job_resumes_on_another_host(tmp_path, bucket):
    with fleet(tmp_path, bucket, 2) as f:
        api = f.api
        started = {h.name: f.start(h) for h in f.net.hosts}
        # Each host's worker advertises the address the others reach it at.
        assert {(w["host"], w["addr"]) for w in api.client().get("/workers").json()} == \
            {(h.name, h.addr) for h in f.net.hosts}
        # Both hosts serve before the job is queued: the cut comes while it trains, however fast this machine.
        job = api.submit(slow_job(epochs=EPOCHS))
        wait_checkpoint(api, job["id"], 2)
        a = next(h for h in f.net.hosts if h.name in api.job(job["id"])["worker_id"])
        b = next(h for h in f.net.hosts if h is not a)
        worker_a = started[a.name]
        pids = job_pids(api, job["id"])
        assert pids and pids[0] in a.pids(), (pids, a.pids())
        assert api.job(job["id"])["state"] == "running"

        a.cut()
        cut_at = time.monotonic()
        api.wait_until(lambda: not any(alive(p) for p in pids), LEASE_S + 2, "host A's job process to stop")
        stopped_in = time.monotonic() - cut_at
        assert worker_a.poll() is None  # the worker itself waits for its network to come back

        done = api.wait_state(job["id"], timeout=240)
        assert done["state"] == "succeeded" and done["runs"] == 2, done
        assert b.name in done["worker_id"], done["worker_id"]
        assert done["result"]["resumed_from_epoch"] is not None and done["result"]["resumed_from_epoch"] >= 2
        assert [m["epoch"] for m in metrics(api, job["id"])] == list(range(1, EPOCHS + 1))
        assert stopped_in <= LEASE_S + 2

        # Host A back on the network: its worker finds the job is no longer its own and serves on.
        a.mend()
        api.wait_until(lambda: any(w["pid"] == worker_a.pid and w["state"] == "idle"
                                   for w in api.client().get("/workers").json()), 90, "host A's worker idle again")
        assert worker_a.poll() is None


RANK = """
import os, sys, torch, torch.distributed as dist
from pathlib import Path
from trainyard.worker import distributed
rank, master = int(sys.argv[1]), sys.argv[2]
world = distributed.World(rank, 2)
distributed.init(world, torch.device("cpu"), Path("unused"), master, rendezvous_s=30)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank {rank}: {t.item():g}", flush=True)
os._exit(0)  # as a job process ends: gloo's teardown racing the other host's exit may abort a finished rank
"""


def test_ranks_on_two_hosts_meet_at_rank_0s_address_and_all_reduce():
    with hosts(2) as net:
        a, b = net.hosts
        master = f"{a.addr}:{free_port()}"
        env = {"GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": str(ROOT)}  # each host's one link to the other
        procs = [subprocess.Popen(h.argv("env", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-c", RANK,
                                         str(rank), master), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for rank, h in enumerate((a, b))]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        assert [o.strip() for o, _ in outs] == ["rank 0: 3", "rank 1: 3"]


GIVE_UP = """
import torch.distributed as dist


def give_up_on_rank_1(ctx, config):
    if ctx.rank == 1:
        raise ValueError(f"rank 1 of {ctx.world_size} (local rank {ctx.local_rank}) gives up")
    dist.barrier()  # rank 0 waits for a rank that will never come
    return {}
"""


@pytest.mark.postgres
def test_a_job_on_two_hosts_takes_the_steps_of_two_ranks_on_one_and_cancel_ends_both(tmp_path, bucket):
    (tmp_path / "plugin").mkdir()
    plugin = probe_plugin(tmp_path / "plugin", "trainyard_give_up", GIVE_UP, ("give_up_on_rank_1",))
    with fleet(tmp_path, bucket, 2) as f:
        a, b = f.net.hosts
        f.start(a, PYTHONPATH=f"{ROOT}:{plugin}")
        f.start(b, PYTHONPATH=f"{ROOT}:{plugin}")
        spec = {**tiny_job(epochs=4, lr=0.05, batch_size=16), "model": {"arch": "mlp", "hidden": [16]}}
        two_hosts = f.api.wait_state(f.api.submit({**spec, "devices": 2, "hosts": 2})["id"], timeout=180)
        assert two_hosts["state"] == "succeeded", (two_hosts["errors"], two_hosts["ranks"])
        assert {r["host"] for r in two_hosts["ranks"]} == {a.name, b.name} and two_hosts["result"]["devices"] == 2
        assert not f.job_processes(a) and not f.job_processes(b)
        listing = subprocess.run([sys.executable, "-m", "trainyard", "jobs", "--url", f.api.url], capture_output=True,
                                 text=True, env={**os.environ, "COLUMNS": "200"}, timeout=60)
        first, second = (r["host"] for r in two_hosts["ranks"])
        assert f"cpu@{first} + cpu@{second}" in listing.stdout, listing.stdout  # each rank's device and host

        # Cancel: every rank on both hosts ends within the grace period.
        job = f.api.submit(across())
        first, second = running_across(f, job["id"])
        assert f.job_processes(second), "the second host runs its rank in a job process of its own"
        with f.api.client() as c:
            assert c.post(f"/jobs/{job['id']}/cancel").status_code == 200
        took = gone_within(f, (a, b), LEASE_S + 2, time.monotonic())
        assert f.api.job(job["id"])["state"] == "cancelled"

        # A rank's own error on the other host is the job's, named, not retried; no rank is left anywhere.
        failed = f.api.wait_state(f.api.submit({**run_job("give_up_on_rank_1"), "devices": 2, "hosts": 2})["id"])
        assert failed["state"] == "failed" and failed["runs"] == 1, failed
        rank_1 = failed["ranks"][1]["host"]
        assert failed["error"]["class"] == "job" and failed["error"]["type"] == "ValueError", failed["error"]
        assert failed["error"]["message"] == f"host {rank_1}: rank 1 of 2 (local rank 0) gives up", failed["error"]
        gone_within(f, (a, b), 10, time.monotonic())

        # The same job on two ranks of one host: the same losses and weights.
        f.start(a)
        one_host = f.api.wait_state(f.api.submit({**spec, "devices": 2})["id"], timeout=180)
        assert one_host["state"] == "succeeded" and {r["host"] for r in one_host["ranks"]} == {a.name}, one_host
        for x, y in zip(metrics(f.api, one_host["id"]), metrics(f.api, two_hosts["id"]), strict=True):
            assert y["train_loss"] == pytest.approx(x["train_loss"], rel=1e-5, abs=1e-6)
            assert y["val_loss"] == pytest.approx(x["val_loss"], rel=1e-5, abs=1e-6)
        w1, w2 = weights(f.api, one_host["id"]), weights(f.api, two_hosts["id"])
        assert w1.keys() == w2.keys()
        for k in w1:
            torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6)
        assert took <= LEASE_S + 2


@pytest.mark.postgres
@pytest.mark.parametrize("loss", ["sigkill", "rank_sigkill", "link_down"])
def test_a_lost_host_ends_the_run_on_every_host_within_the_lease_and_the_job_resumes(tmp_path, bucket, loss):
    with fleet(tmp_path, bucket, 3) as f:
        for h in f.net.hosts:
            f.start(h)
        job = f.api.submit(across())
        first, second = running_across(f, job["id"])
        wait_checkpoint(f.api, job["id"], 2)
        [third] = [h for h in f.net.hosts if h not in (first, second)]
        assert f.job_processes(first) and f.job_processes(second) and not f.job_processes(third)
        run_1 = f.job_processes(first) | f.job_processes(second)

        if loss == "sigkill":  # the second host's worker
            os.kill(f.workers[second.name][0].pid, signal.SIGKILL)
        elif loss == "rank_sigkill":  # the second host's rank, its worker alive
            for pid in f.job_processes(second):
                os.kill(pid, signal.SIGKILL)
        else:
            second.cut()
        lost_at = time.monotonic()
        # The first run's processes, on both hosts: the job may start again on the same hosts at once.
        took = gone_within(f, (first, second), LEASE_S + 2, lost_at, run_1)

        done = f.api.wait_state(job["id"], timeout=300)
        assert done["state"] == "succeeded" and done["runs"] == 2, done
        if loss != "rank_sigkill":  # the second host is gone: the job resumed on the other two
            assert {r["host"] for r in done["ranks"]} == {first.name, third.name}
        why = done["errors"][0]
        # Rank 0's worker saw the host stop heartbeating (HostLost), or a rank's link to the other broke, or the
        # second host's worker saw its rank die (RankLost).
        assert why["class"] == "infrastructure" and why["type"] in ("HostLost", "RankLost"), why
        if why["type"] == "HostLost" or loss == "link_down":  # a link that went down resets no connection
            assert why["type"] == "HostLost" and f"host {second.name} " in why["message"], why
        assert done["result"]["resumed_from_epoch"] >= 2
        assert [m["epoch"] for m in metrics(f.api, job["id"])] == list(range(1, EPOCHS + 1))
        assert took <= LEASE_S + 2
        if loss == "link_down":  # back on the network, the cut host's worker serves on
            worker = f.workers[second.name][0]
            second.mend()
            f.api.wait_until(lambda: any(w["pid"] == worker.pid and w["state"] == "idle"
                                         for w in f.api.client().get("/workers").json()), 90, "the cut host's worker")
            assert worker.poll() is None


@pytest.mark.postgres
def test_a_rank_0_address_no_rank_can_use_fails_the_run_as_infrastructure_naming_it(tmp_path, bucket):
    with fleet(tmp_path, bucket, 2) as f:
        a, b = f.net.hosts
        nowhere = str(ipaddress.ip_address(a.addr) + 200)  # on the hosts' subnet, held by no host
        f.start(a, TRAINYARD_NODE_ADDR=nowhere)
        f.start(b, TRAINYARD_NODE_ADDR=nowhere)
        job = f.api.wait_state(f.api.submit({**tiny_job(), "devices": 2, "hosts": 2, "max_attempts": 1})["id"],
                               timeout=120)
        assert job["state"] == "failed" and job["error"]["class"] == "infrastructure", job
        assert job["error"]["type"] == "RendezvousFailed" and nowhere in job["error"]["message"], job["error"]
        f.api.wait_until(lambda: not f.job_processes(a) and not f.job_processes(b), 10, "no job process left")
