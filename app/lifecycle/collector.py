"""The collector: apply the retention rules, then remove every stored object that no row references, and measure
what the store holds (storage_usage: /storage, trainyard_storage_bytes and _objects in /metrics), and each project
(project_usage: app/lifecycle/project_storage.py, for the stored_bytes limit).

One pass (`collect`): the rules first (app/lifecycle/retention.py: rows only), then a listing of the store, then the
referenced set read from the rows, then the deletes. Reading the rows after listing is what makes it safe beside
jobs that write: a key listed was written before the rows were read, so if a row is to name it, the row already
does, or the key belongs to a run still going. Referenced are:
  - a job that is queued or running: everything of its current run (artifacts/<id>/run-<claim>/, its
    checkpoints/<id>/run-<claim>-*), written before the database names it, and the checkpoint it resumes from;
  - any job's checkpoint_path and artifact_path (the run dir of the run that succeeded, with the exports made of
    it, each until export_ttl_s after it was made);
  - a job's TensorBoard event files (tensorboard/<id>/) while its log is kept (below), or while it has an
    artifact_path or a checkpoint_path (they go with its model, or the checkpoint a retry would resume from);
  - a job's log (logs/<id>.log) unless it ended more than log_ttl_s ago (pinned jobs keep theirs) or had its
    files reclaimed;
  - an uploaded dataset whose meta.json is there (a dataset appears once its meta.json does).
Anything else (a deleted job's objects left by a crash or a failed store, a stale run's files, old checkpoints)
goes once it is older than collect_grace_s, which spares writes in flight that no rule above covers. A temp file
(".<name>.<random>.tmp") counts as the file it becomes. So after a pass the store holds exactly the referenced
keys, plus what is younger than the grace period.

The server process holding the housekeeping lock runs it every collect_s (app/duties/loops.py); POST
/storage/collect runs one at once. Two passes at once are safe: each delete is of an unreferenced key, and the
rules are guarded UPDATEs. Torch-free.
"""
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from trainyard.app.core.layout import EXPORT_FILES, UPLOAD_META_FILE
from trainyard.app.core.settings import Settings
from trainyard.app.core.storage import Entry, Store
from trainyard.app.db import counting, db_now, jobs, read, storage_usage, write
from trainyard.app.lifecycle import host_cache, project_storage, retention
from trainyard.app.lifecycle.references import ACTIVE

log = logging.getLogger("trainyard.collector")
KINDS = ("artifacts", "checkpoints", "exports", "logs", "uploads", "cache")
# The store's folders (app/core/layout.py) and the kind of what each holds (exports sit among artifacts; a job's
# TensorBoard event files count as artifacts too: they are kept as long as its model).
FOLDERS = {"artifacts": "artifacts", "checkpoints": "checkpoints", "logs": "logs", "datasets/uploads": "uploads",
           "tensorboard": "artifacts"}
_EXPORT_NAMES = tuple(EXPORT_FILES.values())


@dataclass(frozen=True)
class Usage:
    kind: str
    bytes: int
    objects: int
    measured_at: float | None  # None: never measured


@dataclass
class Report:
    """What one pass did, and the store as it left it."""
    took_s: float = 0.0
    deleted_objects: int = 0
    deleted_bytes: int = 0
    checkpoints_dropped: int = 0
    jobs_deleted: int = 0
    trials_reclaimed: int = 0
    evicted_objects: int = 0  # this host's copies of bucket objects, past cache_bytes
    usage: list[Usage] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def name_of(key: str) -> tuple[str, str]:
    """(folder, file name) of a key, a temp file's name as the file's it becomes."""
    folder, _, name = key.rpartition("/")
    return folder, name[1:] if name.startswith(".") else name


def kind_of(key: str) -> str | None:
    for folder, kind in FOLDERS.items():
        if key.startswith(folder + "/"):
            return "exports" if kind == "artifacts" and name_of(key)[1].startswith(_EXPORT_NAMES) else kind
    return None


class Referenced:
    """The keys the rows reference, as of one read."""

    def __init__(self, export_ttl_s: float, now: float):
        self.keys: set[str] = set()
        self.dirs: set[str] = set()             # every key under these folders
        self.runs: dict[str, str] = {}          # checkpoints/<id> -> "run-<claim>": a running job's own
        self.projects: dict[int, int] = {}      # job id -> its project (jobs of a project only)
        self.export_ttl_s, self.now = export_ttl_s, now

    def holds(self, entry: Entry) -> bool:
        folder, name = name_of(entry.key)
        if f"{folder}/{name}" in self.keys:
            return True
        run = self.runs.get(folder)
        if run is not None and (name.startswith(run + "-") or name.startswith(run + ".")):
            return True
        if kind_of(entry.key) == "exports" and self.export_ttl_s and self.now - entry.mtime > self.export_ttl_s:
            return False
        parts = folder.split("/")
        return any("/".join(parts[:i]) in self.dirs for i in range(len(parts), 0, -1))


def referenced(engine: Engine, settings: Settings, listing: list[Entry], now: float, objects_now: float
               ) -> Referenced:
    rules, layout = retention.Rules.of(settings), settings.layout
    refs = Referenced(rules.export_ttl_s, objects_now)
    with read(engine) as conn:
        rows = conn.execute(select(jobs.c.id, jobs.c.state, jobs.c.claim, jobs.c.artifact_path, jobs.c.checkpoint_path,
                                   jobs.c.finished_at, jobs.c.pinned, jobs.c.reclaimed, jobs.c.project_id)).all()
    for row in rows:
        if row.project_id is not None:
            refs.projects[row.id] = row.project_id
        if row.state in ACTIVE:
            refs.dirs.add(layout.rel(layout.run_dir(row.id, row.claim)))
            refs.runs[layout.rel(layout.checkpoints(row.id))] = f"run-{row.claim}"
        if row.checkpoint_path:
            refs.keys.add(row.checkpoint_path)
        if row.artifact_path:
            refs.dirs.add(row.artifact_path.rstrip("/"))
        old = row.finished_at is not None and rules.log_ttl_s and row.finished_at < now - rules.log_ttl_s
        kept_log = row.state in ACTIVE or (row.reclaimed is None and (row.pinned or not old))
        if kept_log:
            refs.keys.add(layout.rel(layout.log(row.id)))
        # The event files are the run's record, as its log is (a failed job's curves say why), and stay with its
        # model or the checkpoint a retry resumes from when those outlive the log.
        if kept_log or row.artifact_path or row.checkpoint_path:
            refs.dirs.add(layout.rel(layout.tensorboard(row.id)))
    for entry in listing:
        folder, name = name_of(entry.key)
        if kind_of(entry.key) == "uploads" and name == UPLOAD_META_FILE:
            refs.dirs.add(folder)
    return refs


def collect(engine: Engine, settings: Settings, shift_s: float = 0.0) -> Report:
    """One pass, as if shift_s seconds later than now (the retention benchmark looks a month ahead)."""
    started = time.monotonic()
    store = settings.store
    with read(engine) as conn:
        now = conn.execute(select(db_now())).scalar_one() + shift_s
    applied = retention.apply(engine, retention.Rules.of(settings), now)
    listing = [e for folder in FOLDERS for e in store.entries(folder)]
    objects_now = time.time() + shift_s
    refs = referenced(engine, settings, listing, now, objects_now)
    doomed = [e for e in listing if not refs.holds(e) and objects_now - e.mtime >= settings.collect_grace_s]
    if doomed:
        store.delete_keys([e.key for e in doomed])
        _prune_folders(store, doomed)
        log.info("collector: %d objects (%d bytes) no row references removed from %s",
                 len(doomed), sum(e.size for e in doomed), store.describe())
    evicted = host_cache.evict(store, settings.cache_bytes, settings.collect_grace_s) if store.remote else []
    gone = {e.key for e in doomed}
    kept = [e for e in listing if e.key not in gone]
    usage = _measure(kept, store)
    by_project = project_storage.measure(refs.projects, store, kept)
    with write(engine) as conn:
        project_storage.record(conn, by_project, usage[0].measured_at)
        # An upsert: two passes at once (two hosts' collectors, or POST /storage/collect beside one) both write.
        dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
        stmt = dialect.insert(storage_usage).values([asdict(u) for u in usage])
        conn.execute(stmt.on_conflict_do_update(index_elements=[storage_usage.c.kind], set_={
            c: stmt.excluded[c] for c in ("bytes", "objects", "measured_at")}))
        counting.add(conn, counting.collected([(kind_of(e.key) or "", e.size) for e in doomed]))
    return Report(time.monotonic() - started, len(doomed), sum(e.size for e in doomed), applied.checkpoints_dropped,
                  applied.jobs_deleted, applied.trials_reclaimed, len(evicted), usage)


def _measure(kept: list[Entry], store: Store) -> list[Usage]:
    at = time.time()
    totals = {kind: [0, 0] for kind in KINDS}
    for e in kept:
        kind = kind_of(e.key)
        if kind is not None:
            totals[kind][0] += e.size
            totals[kind][1] += 1
    totals["cache"] = list(host_cache.measure(store))
    return [Usage(kind, b, n, at) for kind, (b, n) in totals.items()]


def _prune_folders(store: Store, doomed: list[Entry]) -> None:
    """Remove the folders the deletes emptied (the data directory's; a bucket has none), up to the store's own."""
    layout = store.layout
    for folder in sorted({name_of(e.key)[0] for e in doomed}, key=len, reverse=True):
        while folder and folder not in FOLDERS:
            try:
                layout.resolve(folder).rmdir()
            except OSError:  # not empty (or gone)
                break
            folder = folder.rpartition("/")[0]


def usage(engine: Engine) -> list[Usage]:
    """What the last pass measured, one per kind (zeros, measured_at None, before the first)."""
    with read(engine) as conn:
        rows = {r.kind: r for r in conn.execute(select(storage_usage)).all()}
    return [Usage(k, rows[k].bytes, rows[k].objects, rows[k].measured_at) if k in rows else Usage(k, 0, 0, None)
            for k in KINDS]
