"""This host's cores as a process may use them (app/fleet/host_cpu.py): its affinity, lowered by the CPU quota
of its cgroups as cgroup v1 and v2 write them. A real worker under a real quota is tests/worker/test_cgroups.py's."""
import os

import pytest

from tests.helpers.cgroups import tree
from trainyard.app.fleet import host_cpu

HERE = len(os.sched_getaffinity(0))


def test_v2_the_lowest_quota_of_the_cgroup_and_its_ancestors(tmp_path):
    fs = tree(tmp_path / "fs", {"cgroup.controllers": "cpu memory\n", "kubepods/cpu.max": "max 100000\n",
                                "kubepods/pod1/cpu.max": "250000 100000\n",
                                "kubepods/pod1/ctr/cpu.max": "300000 50000\n"})
    own = tree(tmp_path, {"cgroup": "0::/kubepods/pod1/ctr\n"}) / "cgroup"
    assert host_cpu.quota(fs, own) == 2.5  # the pod's 2.5 CPUs cap the container's own 6
    assert host_cpu.cores(fs, own) == min(HERE, 2)  # whole cores: a third thread would be throttled
    # Docker's --cpus in its cgroup namespace: mounted at the root, /proc/self/cgroup saying 0::/.
    ns = tree(tmp_path / "ns", {"cgroup.controllers": "cpu\n", "cpu.max": "50000 100000\n"})
    assert host_cpu.quota(ns, tree(tmp_path, {"ns-cgroup": "0::/\n"}) / "ns-cgroup") == 0.5
    assert host_cpu.cores(ns, tmp_path / "ns-cgroup") == 1  # half a core is still one thread


def test_v1_the_quota_of_the_cpu_hierarchy_at_every_level_and_none_for_minus_one(tmp_path):
    fs = tree(tmp_path / "fs", {"unified/cgroup.procs": "",
                                "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
                                "cpu,cpuacct/kubepods/cpu.cfs_quota_us": "150000\n",
                                "cpu,cpuacct/kubepods/cpu.cfs_period_us": "100000\n",
                                "cpu,cpuacct/kubepods/pod1/cpu.cfs_quota_us": "-1\n",
                                "cpu,cpuacct/kubepods/pod1/cpu.cfs_period_us": "100000\n"})
    own = tree(tmp_path, {"v1": "4:memory:/kubepods/pod1\n3:cpu,cpuacct:/kubepods/pod1\nnot a line\n0::/\n"}) / "v1"
    assert host_cpu.quota(fs, own) == 1.5  # the parent's quota holds for the child without one of its own
    assert host_cpu.cores(fs, own) == 1
    top = tree(tmp_path, {"top": "3:cpu,cpuacct:/\n0::/\n"}) / "top"
    assert host_cpu.quota(fs, top) is None
    assert host_cpu.cores(fs, top) == HERE


@pytest.mark.parametrize("text", ["max 100000\n", "", "garbage\n", "100000 0\n", "-5 100000\n", "1 2 3\n"])
def test_no_quota_or_an_unreadable_one_leaves_the_affinity(tmp_path, text):
    fs = tree(tmp_path / "fs", {"cgroup.controllers": "cpu\n", "ctr/cpu.max": text})
    own = tree(tmp_path, {"cgroup": "0::/ctr\n"}) / "cgroup"
    assert host_cpu.quota(fs, own) is None
    assert host_cpu.cores(fs, own) == HERE
    assert host_cpu.cores(tmp_path / "no-fs", tmp_path / "no-such-file") == HERE


def test_a_quota_above_the_affinity_leaves_the_affinity(tmp_path):
    """A pod allowed 64 CPUs on a cpuset of fewer cores gets its cores: the quota only ever lowers."""
    fs = tree(tmp_path / "fs", {"cgroup.controllers": "cpu\n", "cpu.max": f"{(HERE + 62) * 100000} 100000\n"})
    assert host_cpu.cores(fs, tree(tmp_path, {"cgroup": "0::/\n"}) / "cgroup") == HERE


def test_this_process_reads_its_own_cgroups():
    q = host_cpu.quota()
    assert host_cpu.cores() == (HERE if q is None else max(1, min(HERE, int(q))))
