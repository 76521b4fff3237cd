"""This host's cores as a process may use them: its CPU affinity (a cpuset: `docker --cpuset-cpus`, `taskset`),
lowered by the CPU quota of its cgroup and its ancestors (`docker --cpus`, a pod's limits.cpu). Past its quota
the kernel stops a cgroup's threads until the next period (100 ms by default), so a job spinning 64 torch
threads in a pod limited to 4 CPUs spends most of each period stopped. The worker sizes its jobs' torch threads
from cores(); /devices and the heartbeat's host reading show it.
"""
import math
import os
from pathlib import Path

from trainyard.app.fleet.host_memory import OWN, ROOT, cgroup_dirs


def cores(root: Path = ROOT, own: Path = OWN) -> int:
    """The cores this process may keep busy: those of its affinity, or its quota's whole cores where fewer
    (rounded down, as Go's automaxprocs does: a thread more than the quota is throttled in every period; at
    least one)."""
    try:
        n = len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no sched_getaffinity (macOS)
        n = os.cpu_count() or 1
    q = quota(root, own)
    return n if q is None else max(1, min(n, math.floor(q)))


def quota(root: Path = ROOT, own: Path = OWN) -> float | None:
    """The lowest CPU quota over this process, in cores (quota / period), None without one: cgroup v2's
    cpu.max at every level, v1's cpu.cfs_quota_us / cpu.cfs_period_us at its cgroup and each ancestor (v1
    enforces every level's quota too; -1 is none)."""
    found: list[float] = []
    for version, d in cgroup_dirs(root, own, "cpu"):
        if version == 2:
            found += [q for q in [_v2(d / "cpu.max")] if q is not None]
        else:
            found += [q for level in (d, *d.parents) if level.is_relative_to(root)
                      and (q := _v1(level / "cpu.cfs_quota_us", level / "cpu.cfs_period_us")) is not None]
    return min(found, default=None)


def _v2(f: Path) -> float | None:
    """cpu.max: "<quota> <period>" in microseconds, quota "max" for none."""
    try:
        quota_us, period_us = f.read_text().split()
        return int(quota_us) / int(period_us) if int(period_us) > 0 and int(quota_us) > 0 else None
    except (OSError, ValueError):  # absent, "max 100000", or malformed
        return None


def _v1(quota_file: Path, period_file: Path) -> float | None:
    try:
        quota_us, period_us = int(quota_file.read_text()), int(period_file.read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None
