"""What a list of jobs shows of each job's spec (its `summary`), read without loading the specs."""
import functools
import json
from typing import Any

from sqlalchemy import Select, literal_column, select
from sqlalchemy.engine import Connection, Engine

from trainyard.app.db import ids_in, jobs, read
from trainyard.app.records import Job


def spec_summary(kind: str, spec: dict, rows: int | None = None) -> dict[str, Any]:
    """What a list item shows of a job's spec (`summary`): its model and dataset (train); its model job
    and rows, or dataset and split (predict); its entrypoint (run). rows: the inputs' count, for a spec
    read without them."""
    data = spec.get("data") or {}
    if kind == "predict":
        if isinstance(spec.get("inputs"), list):
            rows = len(spec["inputs"])
        about = {"model_job": spec.get("model_job"), "rows": rows, "dataset": data.get("dataset"),
                 "split": data.get("split")}
    elif kind == "run":
        about = {"entrypoint": spec.get("entrypoint")}
    else:
        about = {"arch": (spec.get("model") or {}).get("arch"), "dataset": data.get("dataset")}
    return {k: v for k, v in about.items() if v is not None}


# (id, created_at) -> the job's summary: a spec never changes once stored, so each server process reads
# a job's once. Bounded: past this many it starts over.
_SUMMARIES: dict[tuple[int, float], dict] = {}
_SUMMARIES_KEPT = 20_000
_SUMMARY_PATHS = ("model_job", "model.arch", "data.dataset", "data.split", "entrypoint")


def summaries(engine: Engine, found: list[Job]) -> dict[int, dict]:
    """Each job's spec_summary (summaries_on's, on a connection of its own only when one is read)."""
    if all(job.spec is not None or (job.id, job.created_at) in _SUMMARIES for job in found):
        return summaries_on(None, found)
    with read(engine) as conn:
        return summaries_on(conn, found)


def summaries_on(conn: Connection | None, found: list[Job]) -> dict[int, dict]:
    """Each job's spec_summary, without reading its spec into this process: the database's JSON functions
    pick out the few fields (and a prediction's row count), once per job, in one statement built once per
    dialect; records that carry their spec (read with it) are summed up from it. conn: where to read the jobs
    not yet summed up (None: there are none)."""
    out: dict[int, dict] = {}
    missing: list[int] = []
    for job in found:
        if job.spec is not None:
            out[job.id] = spec_summary(job.kind, job.spec)
        elif (job.id, job.created_at) in _SUMMARIES:
            out[job.id] = _SUMMARIES[(job.id, job.created_at)]
        else:
            missing.append(job.id)
    if not missing or conn is None:
        return out
    rows = conn.execute(_statement(conn.dialect.name), {"ids": missing}).all()
    if len(_SUMMARIES) + len(rows) > _SUMMARIES_KEPT:
        _SUMMARIES.clear()
    for r in rows:
        parts = json.loads(r.parts) if r.parts else [None] * len(_SUMMARY_PATHS)
        spec: dict[str, Any] = {}
        for path, value in zip(_SUMMARY_PATHS, parts):  # back into the spec's shape: "model.arch" -> model.arch
            *outer, last = path.split(".")
            node = spec
            for key in outer:
                node = node.setdefault(key, {})
            node[last] = value
        _SUMMARIES[(r.id, r.created_at)] = out[r.id] = spec_summary(r.kind, spec, r.rows)
    return out


@functools.cache
def _statement(dialect: str) -> Select:
    return select(jobs.c.id, jobs.c.kind, jobs.c.created_at, *_summary_columns(dialect)).where(
        ids_in(jobs.c.id, dialect))


def _summary_columns(dialect: str) -> list:
    """The summary's fields as one JSON array (`parts`, in _SUMMARY_PATHS' order) and the inputs' length (`rows`)."""
    if dialect == "postgresql":
        paths = ", ".join(f"jobs.spec#>'{{{p.replace('.', ',')}}}'" for p in _SUMMARY_PATHS)
        return [literal_column(f"CAST(json_build_array({paths}) AS TEXT)").label("parts"),
                literal_column("CASE WHEN json_typeof(jobs.spec->'inputs') = 'array' "
                               "THEN json_array_length(jobs.spec->'inputs') END").label("rows")]
    paths = ", ".join(f"'$.{p}'" for p in _SUMMARY_PATHS)
    return [literal_column(f"json_extract(jobs.spec, {paths})").label("parts"),
            literal_column("CASE WHEN json_type(jobs.spec, '$.inputs') = 'array' "
                           "THEN json_array_length(jobs.spec, '$.inputs') END").label("rows")]
