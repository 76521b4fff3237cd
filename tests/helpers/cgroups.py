"""A memory cgroup of the tests' own, as a container runtime makes one for `--memory` (a pod: limits.memory):
a child of this process's own cgroup, v1's memory controller or v2's, removed with whatever runs in it."""
import os
import secrets
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def _parent() -> tuple[Path, str] | None:
    """(this process's memory cgroup directory, the file its limit is written to), or None where none can be
    made here (not root, no memory controller, or v2 without memory delegated to children)."""
    if os.geteuid() != 0:
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and (ROOT / "memory" / path.lstrip("/")).is_dir():
            return ROOT / "memory" / path.lstrip("/"), "memory.limit_in_bytes"
        if controllers == "" and (ROOT / "cgroup.controllers").exists():
            d = ROOT / path.lstrip("/")
            if "memory" in (d / "cgroup.subtree_control").read_text().split():
                return d, "memory.max"
    return None


def unavailable() -> str | None:
    parent = _parent()
    if parent is None:
        return "no memory cgroup can be made here (needs root and a memory controller it may use)"
    try:
        probe = parent[0] / f"ty-probe-{secrets.token_hex(3)}"
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"no memory cgroup can be made under {parent[0]}: {exc}"
    return None


@contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[list[str]]:
    """A cgroup limited to limit_bytes; yields the argv prefix that runs a command in it (it execs the rest,
    keeping its pid). On leaving, what still runs there is killed and the cgroup removed."""
    parent = _parent()
    assert parent is not None, unavailable()
    d = parent[0] / f"trainyard-test-{secrets.token_hex(3)}"
    d.mkdir()
    try:
        (d / parent[1]).write_text(str(limit_bytes))
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
