"""What each project stores: the collector's pass (app/lifecycle/collector.py) attributes every object it keeps to a
project
and records the totals (project_usage); the stored_bytes limit (app/accounts/quotas.py), GET /admin/projects and a
member's
GET /storage read them.

A job's objects (artifacts/<id>/..., its exports among them, checkpoints/<id>/..., logs/<id>.log,
tensorboard/<id>/...) are its project's; an uploaded dataset's (datasets/uploads/<id>/...) are the project its
meta.json names. Objects of no project (jobs and uploads of an admin acting in none, or from before accounts)
count for none, and so do those no row names any more (a deleted job's, left until the collector's grace has
passed). A project storing nothing has no row. Torch-free.
"""
import re
import time

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from trainyard.app import uploads
from trainyard.app.core.errors import NotFound
from trainyard.app.core.storage import Entry, Store
from trainyard.app.db import project_usage, read

# The job id a key of each job folder belongs to, and the upload id of an upload's key.
_JOB_KEY = re.compile(r"(?:artifacts|checkpoints|tensorboard)/(\d+)/|logs/\.?(\d+)\.log")
_UPLOAD_KEY = re.compile(r"datasets/uploads/([a-z0-9]{1,64})/")


def measure(owner: dict[int, int], store: Store, kept: list[Entry]) -> dict[int, tuple[int, int]]:
    """Each project's (bytes, objects) among these objects (a listing of the store); owner: each job's project
    (the collector's read of the jobs' rows)."""
    upload_owner: dict[str, int | None] = {}
    totals: dict[int, list[int]] = {}
    for e in kept:
        project = None
        if (m := _JOB_KEY.match(e.key)) is not None:
            project = owner.get(int(m.group(1) or m.group(2)))
        elif (m := _UPLOAD_KEY.match(e.key)) is not None:
            if m.group(1) not in upload_owner:
                upload_owner[m.group(1)] = _upload_project(store, m.group(1))
            project = upload_owner[m.group(1)]
        if project is not None:
            total = totals.setdefault(project, [0, 0])
            total[0] += e.size
            total[1] += 1
    return {p: (b, n) for p, (b, n) in totals.items()}


def _upload_project(store: Store, upload_id: str) -> int | None:
    try:
        return uploads.get(store, upload_id, cached=True).get("project_id")
    except (NotFound, OSError, ValueError):  # no meta.json yet (being written), or one unreadable
        return None


def record(conn: Connection, totals: dict[int, tuple[int, int]], at: float | None = None) -> None:
    """Replace project_usage with these totals (an upsert: two passes at once both write)."""
    at = time.time() if at is None else at
    gone = delete(project_usage)
    if totals:
        dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
        stmt = dialect.insert(project_usage).values([{"project_id": p, "bytes": b, "objects": n, "measured_at": at}
                                                     for p, (b, n) in totals.items()])
        conn.execute(stmt.on_conflict_do_update(index_elements=[project_usage.c.project_id], set_={
            c: stmt.excluded[c] for c in ("bytes", "objects", "measured_at")}))
        gone = gone.where(project_usage.c.project_id.not_in(list(totals)))
    conn.execute(gone)


def of(engine: Engine, project_id: int) -> tuple[int, int]:
    """One project's (bytes, objects) as last measured; (0, 0) when it stores nothing, or none was measured."""
    with read(engine) as conn:
        row = conn.execute(select(project_usage.c.bytes, project_usage.c.objects)
                           .where(project_usage.c.project_id == project_id)).first()
    return (0, 0) if row is None else (int(row.bytes), int(row.objects))


def stored(engine: Engine) -> dict[int, int]:
    """Each project's stored bytes as last measured (a project missing stores nothing, or none was measured)."""
    with read(engine) as conn:
        return {r.project_id: int(r.bytes) for r in conn.execute(select(project_usage.c.project_id,
                                                                       project_usage.c.bytes))}
