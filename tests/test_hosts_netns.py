"""Hosts as separate as this machine can make them: network namespaces of their own, sharing only
PostgreSQL and the S3 server, each reached through the bridge the test makes (tests/netns.py).

Ranks on two hosts meet at rank 0's address through torch's own TCPStore and all-reduce over gloo on
the interface GLOO_SOCKET_IFNAME names. A host whose network link goes down cannot renew its job's
lease: its worker stops the job process when the lease runs out, though every call it makes to the
database hangs, and the job resumes on another host from the bucket's checkpoint with a gapless history.
"""
import subprocess
import sys
import time

import pytest

from bench.common import postgres_schema
from tests.conftest import slow_job
from tests.netns import hosts, unavailable
from tests.service import FAST_ENV, ROOT, Service, free_port
from tests.test_reliability import alive, job_pids, metrics, wait_checkpoint

why_not = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_not is not None, reason=str(why_not))]

LEASE_S = float(FAST_ENV["TRAINYARD_LEASE_S"])
EPOCHS = 30


@pytest.mark.postgres
def test_a_host_cut_off_stops_its_job_within_the_lease_and_the_job_resumes_on_another_host(tmp_path, bucket):
    with hosts(2) as net, postgres_schema("netns") as db_url:
        pg = net.forward(5432)
        s3 = net.forward(int(bucket.env["AWS_ENDPOINT_URL_S3"].rsplit(":", 1)[1]))
        api = Service(tmp_path / "api", db_url, env={**bucket.env, "TRAINYARD_STORAGE_URL": bucket.url,
                                                     "TRAINYARD_NODE_NAME": "api"})
        try:
            api.start_server()
            # What a host is told: the database and the bucket at the bridge's address, a data dir of its own.
            on_bridge = {"TRAINYARD_DATABASE_URL": db_url.replace("127.0.0.1:5432", pg),
                         "AWS_ENDPOINT_URL_S3": f"http://{s3}"}
            a, b = net.hosts
            worker_a = net.start_worker(api, a, {**on_bridge, "TRAINYARD_DATA_DIR": str(tmp_path / a.name),
                                                 "TRAINYARD_NODE_ADDR": a.addr})
            job = api.submit(slow_job(epochs=EPOCHS))
            api.wait_until(lambda: api.job(job["id"])["state"] == "running", 60, "host A to take the job")
            net.start_worker(api, b, {**on_bridge, "TRAINYARD_DATA_DIR": str(tmp_path / b.name),
                                      "TRAINYARD_NODE_ADDR": b.addr})
            # Each host's worker advertises the address the others reach it at.
            assert {(w["host"], w["addr"]) for w in api.client().get("/workers").json()} == \
                {(a.name, a.addr), (b.name, b.addr)}
            wait_checkpoint(api, job["id"], 2)
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
        finally:
            api.stop()


RANK = """
import sys, torch, torch.distributed as dist
from pathlib import Path
from trainyard.worker import distributed
rank, master = int(sys.argv[1]), sys.argv[2]
world = distributed.World(rank, 2)
distributed.init(world, torch.device("cpu"), Path("unused"), master, rendezvous_s=30)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank {rank}: {t.item():g}")
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
