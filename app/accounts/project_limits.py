"""A project's share and limits as the claim, the housekeeper and the quotas use them: each within a bound that
the database columns, and the SQL and arithmetic that use it, can hold.

The API refuses a value past its bound (422: app/api/schemas_admin.py takes its bounds from here). A value stored
before the bounds existed, or written around the API, is read only through `read` (or `bounded`, for a row read
elsewhere: app/accounts/quotas.py's, locked), which never let it reach SQL or arithmetic as it is:
  - a limit over its bound is held at the bound (each bound is past what any fleet holds: it still limits
    nothing the admin did not limit);
  - a limit that is not a number of its range (text, a negative count, NaN, a fraction of a count) is left out:
    the project runs as if it had no such limit (a max_priority left out is app/accounts/quotas.py's default, 0);
  - a share that is not a finite number > 0 weighs 1, the default; one over MAX_SHARE weighs MAX_SHARE.
Each is logged as a warning naming the project and the key the first time a process reads it, and again every
WARN_EVERY_S while it stays: the claim and the housekeeper read limits many times a second, and one bad row must
be loud without flooding the log. Keys this module has no bound for pass as they are. Torch-free.
"""
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from trainyard.app.db import projects

log = logging.getLogger("trainyard.limits")


@dataclass(frozen=True)
class Bound:
    """What a limit may hold: a whole number (`whole`) or any number, from `least` to `most`."""
    most: float
    whole: bool = True
    least: float = 0


# A count is compared in SQL against sums and counts of rows: each stays within a 32-bit INTEGER (and a device count
# far past any fleet); GPU memory is turned into bytes (times 1e9) beside BIGINT sums, and matches the largest
# device_memory_gb a worker may offer (app/core/settings.py); stored bytes within 2**62, as every byte count here.
BOUNDS: dict[str, Bound] = {
    "devices": Bound(1_000_000),
    "gpu_memory_gb": Bound(1_000_000, whole=False),
    "queued_jobs": Bound(1_000_000_000),
    "running_sweeps": Bound(1_000_000_000),
    "stored_bytes": Bound(2**62),
    "max_priority": Bound(1000, least=-1000),  # the range of a job's priority (app/spec/jobs.py)
}
MAX_SHARE = 1_000_000.0
WARN_EVERY_S = 600.0


@dataclass(frozen=True)
class ProjectLimits:
    """A project's name, share (finite, > 0) and limits (each within its bound), as read."""
    id: int
    name: str
    share: float
    limits: dict[str, Any]


def read(conn: Connection, ids: Iterable[int] | None = None) -> dict[int, ProjectLimits]:
    """Every project's (or these projects') share and limits, bounded, by id."""
    q = select(projects.c.id, projects.c.name, projects.c.share, projects.c.limits)
    if ids is not None:
        q = q.where(projects.c.id.in_(list(ids)))
    return {r.id: bounded(r.id, r.name, r.share, r.limits) for r in conn.execute(q)}


def bounded(project_id: int, name: str, share: Any, limits: Any) -> ProjectLimits:
    """A project row's share and limits held to their bounds (the module's docstring says how), logging each
    value it changes."""
    if limits is None:
        limits = {}
    if not isinstance(limits, dict):
        _warn(project_id, name, "limits", limits, "is not an object of limits: it has none")
        limits = {}
    out = {}
    for key, value in limits.items():
        if value is None or key not in BOUNDS:
            if value is not None:
                out[key] = value
            continue
        held = _bounded(project_id, name, key, value, BOUNDS[key])
        if held is not None:
            out[key] = held
    return ProjectLimits(project_id, name, _share(project_id, name, share), out)


def _bounded(project_id: int, name: str, key: str, value: Any, bound: Bound) -> int | float | None:
    # No float() or math on the value before the bounds: JSON holds integers of any size (and SQLite, infinities).
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or value != value or value < bound.least:  # value != value: NaN
        _left_out(project_id, name, key, value, bound)
        return None
    if value > bound.most:
        _warn(project_id, name, key, value, f"is over the most it may be ({bound.most:g}): held at that")
        return int(bound.most) if bound.whole else float(bound.most)
    if bound.whole and value != int(value):
        _left_out(project_id, name, key, value, bound)
        return None
    return int(value) if bound.whole else float(value)


def _left_out(project_id: int, name: str, key: str, value: Any, bound: Bound) -> None:
    _warn(project_id, name, key, value, f"is not a {'whole ' if bound.whole else ''}number >= {bound.least:g}: "
                                        "the project has no such limit")


def _share(project_id: int, name: str, share: Any) -> float:
    number = isinstance(share, (int, float)) and not isinstance(share, bool)
    if not number or share != share or share <= 0 or share == math.inf:
        _warn(project_id, name, "share", share, "is not a finite number > 0: it weighs 1")
        return 1.0
    if share > MAX_SHARE:
        _warn(project_id, name, "share", share, f"is over the most it may be ({MAX_SHARE:g}): held at that")
        return MAX_SHARE
    return float(share)


_warned: dict[tuple[int, str, str], float] = {}


def _warn(project_id: int, name: str, key: str, value: Any, meaning: str) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    mark = (project_id, key, shown)
    now = time.monotonic()
    if now - _warned.get(mark, -math.inf) < WARN_EVERY_S:
        return
    if len(_warned) > 1000:  # distinct bad values are few; this only keeps a pathological table from growing it
        _warned.clear()
    _warned[mark] = now
    log.warning("project %r: its stored %s %s %s; set it again through the API (PATCH /admin/projects/%s)",
                name, key, shown, meaning, name)
