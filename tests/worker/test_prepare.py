"""A claimed job's plan on its host (worker/supervisor/prepare.py): its share of the cores this worker may use, and,
for a job
across hosts, which ranks run here and where they meet."""
import os
from dataclasses import replace

import pytest

from tests.helpers.jobs import tiny_job
from tests.helpers.runner import job_record
from trainyard.app.core.settings import Settings
from trainyard.app.fleet import host_cpu
from trainyard.worker.supervisor import prepare


def plan(tmp_path, job, node="hostB", cpu_workers=1):
    settings = Settings(data_dir=tmp_path, node_name=node, node_addr="10.9.0.2")
    here = {"all": [{}] * cpu_workers, "cpu": [{}] * cpu_workers}
    return prepare.plan_job(job, settings, "cpu", lambda *a: None, here, None)


@pytest.fixture
def one_core():
    """This process (and so the worker it stands for) allowed on one core only, as `taskset -c` or a cpuset does."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    yield
    os.sched_setaffinity(0, before)


def test_cpu_jobs_share_the_cores_the_worker_may_use_not_every_core_of_the_machine(tmp_path, one_core):
    assert host_cpu.cores() == 1
    assert plan(tmp_path, job_record(tiny_job())).threads == 1


def test_cpu_jobs_share_a_hosts_cores_among_its_cpu_workers(tmp_path):
    cores = host_cpu.cores()
    assert plan(tmp_path, job_record(tiny_job())).threads == cores
    assert plan(tmp_path, job_record(tiny_job()), cpu_workers=cores * 2).threads == 1


def test_a_job_across_hosts_runs_this_hosts_ranks_meeting_at_rank_0s_address(tmp_path):
    ranks = [{"worker": "a0", "device": "cpu", "host": "hostA", "addr": "10.9.0.1", "port": "4567"},
             {"worker": "b0", "device": "cpu", "host": "hostB", "addr": "10.9.0.2"},
             {"worker": "b1", "device": "cpu", "host": "hostB", "addr": "10.9.0.2"}]
    job = replace(job_record({**tiny_job(), "devices": 3}), ranks=ranks, hosts=2)
    got = plan(tmp_path, job)
    assert got.local_ranks == (1, 2) and got.master == "10.9.0.1:4567" and got.node_addr == "10.9.0.2"
    assert got.ranks == ("cpu", "cpu", "cpu")
    # On one host: every rank forked by rank 0's process, meeting through a file store.
    one_host = plan(tmp_path, replace(job, ranks=[{"worker": r["worker"], "device": "cpu", "host": "hostB"}
                                                  for r in ranks], hosts=None))
    assert one_host.local_ranks == () and one_host.master == ""
