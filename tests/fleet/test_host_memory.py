"""This host's memory as a process may use it (app/fleet/host_memory.py): the kernel's files as cgroup v1 and
v2 write them, and this process's own reading. A real worker in a real memory cgroup is
tests/worker/test_cgroups.py's."""
from pathlib import Path

from tests.helpers.cgroups import tree
from trainyard.app.fleet import host_memory

GiB = 1 << 30


def test_v2_the_lowest_limit_of_the_cgroup_and_its_ancestors(tmp_path):
    fs = tree(tmp_path / "fs", {"cgroup.controllers": "cpu memory\n", "memory.max": "max\n",
                                "kubepods/memory.max": f"{8 * GiB}\n", "kubepods/pod1/memory.max": "max\n",
                                "kubepods/pod1/ctr/memory.max": f"{12 * GiB}\n"})
    own = tree(tmp_path, {"cgroup": "0::/kubepods/pod1/ctr\n"}) / "cgroup"
    assert host_memory.cgroup_limit(fs, own) == 8 * GiB  # the pod's parent caps the container's own 12 GiB


def test_v2_in_a_cgroup_namespace_reads_the_mount_it_has(tmp_path):
    """Docker's default: /proc/self/cgroup says 0::/ and the container's cgroup is mounted at /sys/fs/cgroup."""
    fs = tree(tmp_path / "fs", {"cgroup.controllers": "memory\n", "memory.max": f"{6 * GiB}\n"})
    assert host_memory.cgroup_limit(fs, tree(tmp_path, {"cgroup": "0::/\n"}) / "cgroup") == 6 * GiB
    # A path the mount does not show (namespaced below it): its tail is looked for, then the mount's root.
    assert host_memory.cgroup_limit(fs, tree(tmp_path, {"cgroup": "0::/system.slice/docker-1.scope\n"}) / "cgroup") \
        == 6 * GiB


def test_v1_the_hierarchical_limit_and_none_where_there_is_none(tmp_path):
    fs = tree(tmp_path / "fs", {"unified/cgroup.procs": "",
                                "memory/docker/abc/memory.stat": f"cache 0\nhierarchical_memory_limit {5 * GiB}\n",
                                "memory/memory.stat": "cache 0\nhierarchical_memory_limit 9223372036854771712\n"})
    v1 = tree(tmp_path, {"v1": "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\nnot a line\n0::/\n"}) / "v1"
    assert host_memory.cgroup_limit(fs, v1) == 5 * GiB
    unlimited = tree(tmp_path, {"top": "4:memory:/\n0::/\n"}) / "top"
    assert host_memory.cgroup_limit(fs, unlimited) is None  # v1's "no limit" is the largest page-aligned int64
    assert host_memory.cgroup_limit(fs, tmp_path / "no-such-file") is None
    assert host_memory.cgroup_limit(tmp_path / "empty", v1) is None


def test_the_total_and_what_is_available_are_the_tightest_of_the_host_and_every_limited_level(tmp_path):
    meminfo = tree(tmp_path, {"meminfo": f"MemTotal: {64 * GiB // 1024} kB\nMemAvailable: {40 * GiB // 1024} kB\n"
                                          "Buffers: 1 kB\n"}) / "meminfo"
    fs = tree(tmp_path / "fs", {"cgroup.controllers": "memory\n",
                                "pod/memory.max": f"{8 * GiB}\n", "pod/memory.current": f"{5 * GiB}\n",
                                "pod/memory.stat": f"anon 1\ninactive_file {GiB}\n",
                                "pod/ctr/memory.max": f"{12 * GiB}\n", "pod/ctr/memory.current": f"{5 * GiB}\n"})
    own = tree(tmp_path, {"cgroup": "0::/pod/ctr\n"}) / "cgroup"
    # The pod leaves 8 - (5 - 1 of reclaimable file pages) = 4 GiB; its container 12 - 5 = 7; the host 40.
    assert host_memory.reading(fs, own, meminfo) == (8 * GiB, 4 * GiB)
    v1 = tree(tmp_path / "v1", {"memory/ctr/memory.stat": f"hierarchical_memory_limit {5 * GiB}\n"
                                                          f"total_inactive_file {GiB}\n",
                                "memory/ctr/memory.usage_in_bytes": f"{3 * GiB}\n"})
    own_v1 = tree(tmp_path, {"v1cgroup": "4:memory:/ctr\n0::/\n"}) / "v1cgroup"
    assert host_memory.reading(v1, own_v1, meminfo) == (5 * GiB, 3 * GiB)
    # Without a limit (or without cgroups at all) both are the host's.
    bare = tmp_path / "no-such-file"
    assert host_memory.reading(fs, bare, meminfo) == (64 * GiB, 40 * GiB)
    assert host_memory.total(fs, own, meminfo) == 8 * GiB


def test_this_process_total_is_the_lower_of_the_host_and_its_cgroup():
    host = int(next(line for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemTotal:")).split()[1]) * 1024
    limit = host_memory.cgroup_limit()
    assert host_memory.total() == (min(host, limit) if limit is not None else host)
