"""Jobs across hosts, as the queue and the placement see them: the spec's shape, the claim that borrows workers
of several hosts in one transaction, why such a job waits, which worker runs which host's ranks, and how rank
0's worker learns that a host is gone (app/fleet/spread.py), on each backend (`engine`). The same on hosts of their own:
tests/worker/test_hosts_netns.py."""
import pytest
from sqlalchemy import update

from tests.helpers.jobs import tiny_job
from trainyard.app.db import workers, write
from trainyard.app.fleet import placement, spread, waiting
from trainyard.app.fleet import workers as registry
from trainyard.app.jobs import queue, submit
from trainyard.app.spec import parse_spec

LEASE = 10.0


def worker(engine, wid, host, addr=None, device="cpu"):
    registry.register_worker(engine, wid, host, 1, device, {"slot": {"key": wid}, "addr": addr})
    return placement.Slot(wid, addr=addr, gang=8)


def spread_job(engine, devices=2, hosts=2, **over):
    job, _ = submit.enqueue(engine, parse_spec({**tiny_job(), "devices": devices, "hosts": hosts, **over}))
    return job


def test_the_spec_spreads_devices_evenly_over_hosts():
    assert parse_spec({**tiny_job(), "devices": 4, "hosts": 2}).host_count == 2
    assert parse_spec({**tiny_job(), "devices": 4}).host_count == 1
    with pytest.raises(ValueError, match="hosts: 3 devices do not spread evenly over 2 hosts"):
        parse_spec({**tiny_job(), "devices": 3, "hosts": 2})
    with pytest.raises(ValueError, match="hosts: a job on 1 device"):
        parse_spec({**tiny_job(), "hosts": 2})


def test_a_claim_takes_workers_of_several_hosts_and_records_where_the_ranks_meet(engine):
    a0 = worker(engine, "a0", "hostA", "10.9.0.1")
    worker(engine, "a1", "hostA", "10.9.0.1")
    worker(engine, "b0", "hostB", "10.9.0.2")
    worker(engine, "b1", "hostB", "10.9.0.2")
    worker(engine, "c0", "hostC", None)  # no address: never a rank of a job across hosts
    worker(engine, "c1", "hostC", None)
    job = spread_job(engine, devices=4, hosts=2)
    got = queue.claim(engine, "a0", "cpu", LEASE, None, a0, port=4567)
    assert got.id == job.id and got.hosts == 2
    assert [(r["worker"], r["host"], r.get("addr")) for r in got.ranks] == [
        ("a0", "hostA", "10.9.0.1"), ("a1", "hostA", "10.9.0.1"), ("b0", "hostB", "10.9.0.2"),
        ("b1", "hostB", "10.9.0.2")]
    assert spread.master(got.ranks) == "10.9.0.1:4567"
    assert spread.ranks_on(got.ranks, "hostB") == (2, 3)
    assert spread.part_leaders(got.ranks) == {"hostB": "b0"}
    # hostB's first lent worker runs hostB's ranks; nobody else runs a part of it.
    assert spread.part_to_run(engine, "b0", "hostB").id == job.id
    assert spread.part_to_run(engine, "b1", "hostB") is None
    assert spread.part_to_run(engine, "a1", "hostA") is None
    # The lent workers claim nothing else meanwhile.
    spread_job(engine, devices=1, hosts=1)
    assert queue.claim(engine, "b1", "cpu", LEASE, None, placement.Slot("b1", addr="10.9.0.2", gang=8)) is None


def test_a_job_across_hosts_waits_for_hosts_with_addresses_and_says_why(engine):
    a0 = worker(engine, "a0", "hostA", "10.9.0.1")
    worker(engine, "b0", "hostB", None)
    job = spread_job(engine)
    assert queue.claim(engine, "a0", "cpu", LEASE, None, a0, port=1) is None  # hostB's worker has no address
    listed, _ = registry.list_workers(engine)
    assert waiting.why_waiting(job, listed) == (
        "needs 2 hosts with 1 device(s) of one kind each, whose workers set TRAINYARD_NODE_ADDR; 1 such host(s) "
        "have live, undrained workers (hostA)")
    # A worker without an address of its own never claims such a job: its ranks could not be reached.
    worker(engine, "b1", "hostB", "10.9.0.2")
    assert queue.claim(engine, "b0", "cpu", LEASE, None, placement.Slot("b0", gang=8), port=1) is None
    listed, _ = registry.list_workers(engine)
    assert waiting.why_waiting(job, listed) is None
    got = queue.claim(engine, "b1", "cpu", LEASE, None, placement.Slot("b1", addr="10.9.0.2", gang=8), port=99)
    assert [r["worker"] for r in got.ranks] == ["b1", "a0"] and spread.master(got.ranks) == "10.9.0.2:99"


def test_one_host_jobs_are_placed_as_before(engine):
    a0 = worker(engine, "a0", "hostA", "10.9.0.1")
    worker(engine, "b0", "hostB", "10.9.0.2")
    spread_job(engine, devices=2, hosts=1)
    assert queue.claim(engine, "a0", "cpu", LEASE, None, a0, port=1) is None  # no second worker on hostA
    worker(engine, "a1", "hostA", "10.9.0.1")
    got = queue.claim(engine, "a0", "cpu", LEASE, None, a0, port=1)
    assert [r["worker"] for r in got.ranks] == ["a0", "a1"] and spread.master(got.ranks) == ""


def test_rank_0s_worker_sees_a_host_whose_part_leader_stopped_heartbeating(engine):
    a0 = worker(engine, "a0", "hostA", "10.9.0.1")
    worker(engine, "b0", "hostB", "10.9.0.2")
    spread_job(engine)
    got = queue.claim(engine, "a0", "cpu", LEASE, None, a0, port=1)
    assert spread.lost_hosts(engine, got, LEASE) == []
    with write(engine) as conn:
        conn.execute(update(workers).where(workers.c.id == "b0").values(last_heartbeat=0.0))
    assert spread.lost_hosts(engine, got, LEASE) == ["hostB (worker b0)"]
    registry.worker_heartbeat(engine, "b0", "stopped", None)
    assert spread.lost_hosts(engine, got, LEASE) == ["hostB (worker b0)"]
