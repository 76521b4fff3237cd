"""Cgroups of the tests' own, as a container runtime makes one for `--memory` or `--cpus` (a pod: limits.memory,
limits.cpu): a child of this process's own cgroup, v1's controller or v2's, removed with whatever runs in it.
And tree(): a cgroup filesystem's files as the kernel writes them, for the readers' unit tests."""
import os
import secrets
import signal
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


# Each controller's file for its limit: cgroup v1's, v2's.
LIMITS = {"memory": ("memory.limit_in_bytes", "memory.max"),
          "cpu": ("cpu.cfs_quota_us", "cpu.max")}
PERIOD_US = 100_000  # the kernel's default CFS period


def _parent(controller: str) -> tuple[Path, int] | None:
    """(this process's cgroup directory of controller, its cgroup version), or None where none can be made here
    (not root, no such controller, or v2 without it delegated to children)."""
    if os.geteuid() != 0:
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") and (ROOT / controller / path.lstrip("/")).is_dir():
            return ROOT / controller / path.lstrip("/"), 1
        if controllers == "" and (ROOT / "cgroup.controllers").exists():
            d = ROOT / path.lstrip("/")
            if controller in (d / "cgroup.subtree_control").read_text().split():
                return d, 2
    return None


def unavailable(controller: str = "memory") -> str | None:
    parent = _parent(controller)
    if parent is None:
        return f"no {controller} cgroup can be made here (needs root and a {controller} controller it may use)"
    try:
        probe = parent[0] / f"ty-probe-{secrets.token_hex(3)}"
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"no {controller} cgroup can be made under {parent[0]}: {exc}"
    return None


def memory_cgroup(limit_bytes: int) -> AbstractContextManager[list[str]]:
    """A cgroup limited to limit_bytes of memory: see _cgroup."""
    return _cgroup("memory", str(limit_bytes), str(limit_bytes))


def cpu_cgroup(cores: float) -> AbstractContextManager[list[str]]:
    """A cgroup whose CPU quota is cores (as `docker --cpus`): see _cgroup."""
    quota = round(cores * PERIOD_US)
    return _cgroup("cpu", str(quota), f"{quota} {PERIOD_US}")


@contextmanager
def _cgroup(controller: str, v1_limit: str, v2_limit: str) -> Iterator[list[str]]:
    """A cgroup whose controller's limit file holds its limit, as cgroup v1 or v2 writes it; yields the argv prefix
    that runs a command in it (it execs the rest, keeping its pid). On leaving, what still runs there is killed
    and the cgroup removed."""
    parent = _parent(controller)
    assert parent is not None, unavailable(controller)
    where, version = parent
    d = where / f"trainyard-test-{secrets.token_hex(3)}"
    d.mkdir()
    try:
        (d / LIMITS[controller][version - 1]).write_text(v1_limit if version == 1 else v2_limit)
        yield ["sh", "-c", f'echo $$ > {d}/cgroup.procs && exec "$@"', "sh"]
    finally:
        deadline = time.monotonic() + 10
        while (pids := [int(p) for p in (d / "cgroup.procs").read_text().split()]) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        d.rmdir()


def tree(root: Path, files: dict[str, str]) -> Path:
    """root with files (paths under it: their text) written, as a cgroup filesystem or /proc shows them."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root
