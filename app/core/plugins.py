"""Plugins: models, datasets and whole training programs that an operator installs on worker hosts
as Python packages, found through entry points. Clients only name what is installed.

    [project.entry-points."trainyard.models"]        name = "pkg.module:factory"
    [project.entry-points."trainyard.datasets"]      name = "pkg.module:loader"
    [project.entry-points."trainyard.entrypoints"]   name = "pkg.module:main"

Discovering reads package metadata only (torch-free, nothing is imported); `load` imports one
plugin, in a job process. Workers report what they have when they register, so the API knows
what a job may name and the claim sends each job only to a worker that has its plugins.
"""
import importlib.metadata
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

GROUPS = {"models": "trainyard.models", "datasets": "trainyard.datasets", "entrypoints": "trainyard.entrypoints"}
# What a plugin may be called: it travels in specs, log lines and the claim's SQL parameters.
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,99}")


@dataclass(frozen=True)
class Plugin:
    kind: str           # models, datasets or entrypoints
    name: str
    value: str          # "module:attr"
    distribution: str | None
    version: str | None


def installed() -> list[Plugin]:
    """The plugins installed in this Python environment, by kind and name."""
    found = []
    for kind, group in GROUPS.items():
        for ep in importlib.metadata.entry_points(group=group):
            if not NAME.fullmatch(ep.name):
                continue  # a name no spec could carry
            dist = ep.dist
            found.append(Plugin(kind, ep.name, ep.value, dist.metadata["Name"] if dist else None,
                                dist.version if dist else None))
    return sorted(found, key=lambda p: (p.kind, p.name))


def offered(allowed: str) -> list[Plugin]:
    """The installed plugins this process offers (TRAINYARD_PLUGINS: "*" all, "" none, or names)."""
    found = installed()
    if allowed.strip() == "*":
        return found
    wanted = {n.strip() for n in allowed.split(",") if n.strip()}
    return [p for p in found if p.name in wanted]


def names(plugins: list[Plugin]) -> dict[str, list[str]]:
    """{"models": [...], "datasets": [...], "entrypoints": [...]}: what a worker reports."""
    return {kind: sorted(p.name for p in plugins if p.kind == kind) for kind in GROUPS}


def describe(plugins: list[Plugin]) -> list[dict[str, Any]]:
    return [asdict(p) for p in plugins]


def load(kind: str, name: str) -> Callable:
    """Import one plugin (in a job process). LookupError when this environment lacks it."""
    for ep in importlib.metadata.entry_points(group=GROUPS[kind]):
        if ep.name == name:
            return ep.load()
    raise LookupError(f"no {kind[:-1]} plugin {name!r} is installed on this worker")
