"""A worker in a container shares its cgroup's memory limit and CPU quota, not the host's memory and cores: its
jobs' memory budget (the default, TRAINYARD_JOB_MEMORY_SHARE of it) is reckoned from the lower of the two, its
jobs' torch threads from the quota's whole cores, and /devices shows both. A real worker in a real cgroup; the
kernel's files as cgroup v1 and v2 write them are tests/fleet/test_host_memory.py's and test_host_cpu.py's."""
import os
import re
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from tests.helpers.cgroups import cpu_cgroup, memory_cgroup, unavailable
from tests.helpers.jobs import tiny_job
from tests.helpers.service import Service

GiB = 1 << 30
why_not = unavailable()  # once: it makes and removes a probe cgroup
why_not_cpu = unavailable("cpu")


def one_job_in(cgroup: AbstractContextManager[list[str]], data_dir: Path) -> tuple[str, dict]:
    """A server here and one CPU worker in cgroup run a tiny job: its log, and /devices' one host (its
    heartbeat's reading)."""
    svc = Service(data_dir)
    with cgroup as run_in_it:
        try:
            svc.start_server()
            svc.start_worker("cpu", wrap=run_in_it)
            job = svc.wait_state(svc.submit(tiny_job())["id"], timeout=120)
            assert job["state"] == "succeeded", job
            with svc.client() as c:
                log = c.get(f"/jobs/{job['id']}/logs").text
                (host,) = c.get("/devices").json()["hosts"]
        finally:
            svc.stop()
    return log, host


@pytest.mark.slow
@pytest.mark.skipif(why_not is not None, reason=str(why_not))
def test_a_worker_in_a_memory_cgroup_gives_its_jobs_a_share_of_the_cgroup_limit_and_shows_it(tmp_path):
    log, host = one_job_in(memory_cgroup(3 * GiB), tmp_path / "data")
    budget = re.search(r"memory budget ([\d.]+) GiB", log)
    assert budget and float(budget.group(1)) == pytest.approx(0.8 * 3, abs=0.01), log  # one live worker here
    assert host["cpu"]["memory_total"] == 3 * GiB
    assert 0 < host["cpu"]["memory_available"] < 3 * GiB  # less what the worker and its fork server hold


@pytest.mark.slow
@pytest.mark.skipif(why_not_cpu is not None, reason=str(why_not_cpu))
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a quota below the affinity needs two cores")
def test_a_worker_under_a_cpu_quota_gives_its_jobs_the_quotas_cores_and_shows_them(tmp_path):
    """`docker --cpus 1.5` (a pod's limits.cpu: 1500m) on a host of two cores or more: one torch thread a job,
    not one a core of the host that the quota would stop for part of every period."""
    log, host = one_job_in(cpu_cgroup(1.5), tmp_path / "data")
    assert ", 1 torch threads" in log, log
    assert host["cpu"]["cores"] == 1
