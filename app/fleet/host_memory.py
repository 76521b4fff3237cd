"""This host's memory as its processes may use it: the kernel's MemTotal and MemAvailable, lowered by the
memory limits of this process's cgroup and its ancestors (a container's --memory, a pod's limits.memory),
past which the kernel kills a process of the container, whatever the host has free. The worker reckons its
jobs' default budget from total(); /devices and the heartbeat's host reading show reading(): total and
available. Which cgroup directories count for this process is cgroup_dirs()'s, for the CPU quota too.
"""
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# Past this a cgroup's limit is none: v1 writes "no limit" as the largest page-aligned int64.
NO_LIMIT = 1 << 62
ROOT = Path("/sys/fs/cgroup")
OWN = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class Limit:
    """One cgroup's memory limit and what its processes hold of it that the kernel cannot reclaim: its usage
    less its inactive file pages (the working set, as docker stats and the kubelet count it)."""
    limit: int
    used: int | None


def total(root: Path = ROOT, own: Path = OWN, meminfo: Path = MEMINFO) -> int:
    """The host's memory, or the lowest limit of this process's cgroups where lower."""
    return reading(root, own, meminfo)[0]


def reading(root: Path = ROOT, own: Path = OWN, meminfo: Path = MEMINFO) -> tuple[int, int | None]:
    """(total, available): the host's MemTotal, or the lowest limit of this process's cgroups where lower; what a
    new process could still take, the host's MemAvailable or what the tightest cgroup leaves where less."""
    found = limits(root, own)
    host = _meminfo(meminfo)
    left = [n for n in (host.get("MemAvailable"), *(c.limit - c.used for c in found if c.used is not None))
            if n is not None]
    host_total = host.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min([host_total, *(c.limit for c in found)]), max(0, min(left)) if left else None


def cgroup_limit(root: Path = ROOT, own: Path = OWN) -> int | None:
    """The lowest memory limit of this process's cgroup and its ancestors, None without one."""
    return min((c.limit for c in limits(root, own)), default=None)


def limits(root: Path = ROOT, own: Path = OWN) -> list[Limit]:
    """The memory limits over this process: cgroup v2's memory.max at every level (each caps what is below
    it), v1's hierarchical_memory_limit (which already sums up its ancestors')."""
    found: list[Limit] = []
    for version, d in cgroup_dirs(root, own, "memory"):
        if version == 2 and (limit := _number(d / "memory.max")) is not None:
            found.append(Limit(limit, _working_set(_number(d / "memory.current"), d, "inactive_file")))
        elif version == 1 and (limit := _stat(d / "memory.stat", "hierarchical_memory_limit")) is not None:
            found.append(Limit(limit, _working_set(_number(d / "memory.usage_in_bytes"), d, "total_inactive_file")))
    return found


@lru_cache(maxsize=16)
def cgroup_dirs(root: Path, own: Path, controller: str) -> tuple[tuple[int, Path], ...]:
    """The cgroup directories whose files of controller ("memory", "cpu") count for this process, each with its
    cgroup version: v2's cgroup and every ancestor, v1's cgroup in that controller's hierarchy. Found once: read
    at every heartbeat, and a process's cgroups do not change under it. A cgroup namespace (a container's)
    mounts its own cgroup at root: a path /proc/self/cgroup names that is not there is looked for by its tail.
    app/fleet/host_cpu.py reads the CPU quota through it."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return ()
    found: list[tuple[int, Path]] = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        parts = [p for p in path.split("/") if p]
        if controllers == "":
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            d = _existing(base, parts)
            found += [(2, level) for level in (d, *d.parents) if level.is_relative_to(base)]
        elif controller in controllers.split(","):
            # v1 mounts a hierarchy per controller set ("cpu,cpuacct"), usually with a link per controller.
            base = root / controllers if (root / controllers).is_dir() else root / controller
            found.append((1, _existing(base, parts)))
    return tuple(found)


def _meminfo(f: Path) -> dict[str, int]:
    """MemTotal and MemAvailable in bytes, those that could be read."""
    try:
        lines = f.read_text().splitlines()
    except OSError:
        return {}
    return {key: int(value.split()[0]) * 1024 for key, _, value in (line.partition(":") for line in lines)
            if key in ("MemTotal", "MemAvailable") and value.split() and value.split()[0].isdigit()}


def _existing(base: Path, parts: list[str]) -> Path:
    """base/parts, or base/ its longest tail that exists (a namespaced mount), or base."""
    for i in range(len(parts) + 1):
        if (d := base.joinpath(*parts[i:])).is_dir():
            return d
    return base


def _working_set(usage: int | None, d: Path, inactive_key: str) -> int | None:
    if usage is None:
        return None
    return max(0, usage - (_stat(d / "memory.stat", inactive_key) or 0))


def _number(f: Path) -> int | None:
    try:
        text = f.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < NO_LIMIT else None


def _stat(f: Path, key: str) -> int | None:
    """One key of a memory.stat file; a limit of none (v1's largest int64) or a malformed line is None."""
    try:
        lines = f.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value) if int(value) < NO_LIMIT else None
    return None
