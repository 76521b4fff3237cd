"""Every released database upgrades: the database of each schema any release made (tests/fixtures/releases,
made by each release's own code with make_release_dbs.py: its create_all or its migrations, its queue) is
brought to this release's schema by the real upgrade path, on SQLite and on PostgreSQL (every release ran
on both: the fixtures hold each release's PostgreSQL database as pg_dump wrote it), keeps its rows, and
then serves this release's reads and claims; the first release's through `trainyard db upgrade` and the
real server. A database that no release made is refused, not stamped."""
import sqlite3
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from tests.helpers.service import ROOT, Service
from trainyard.app.db import make_engine, metadata, migrate
from trainyard.app.db.migrate_releases import SchemaUnknown
from trainyard.app.jobs import queue
from trainyard.app.launcher import postgres_schema
from trainyard.app.records import job_reads

RELEASES = Path(__file__).parents[1] / "fixtures" / "releases"
FIXTURES = sorted(p.name.split(".")[0] for p in RELEASES.glob("*.postgresql.sql"))
JOBS = ("SELECT id, name, state, spec, attempt, claim, epoch, latest_metrics, artifact_path, result FROM jobs "
        "ORDER BY id")
METRICS = "SELECT job_id, epoch, attempt, data FROM metrics ORDER BY job_id, epoch"


# The schemas releases made, by the first release that made each (make_release_dbs.py finds them), and the
# revision its database is at: before migrations (b9575d1) none, so the baseline.
MADE_AT = {"617d61b": "0001", "9698f5c": "0001", "01cf243": "0001", "d8193b8": "0001", "4979be0": "0001",
           "e42724a": "0001", "b9575d1": "0002", "9c67e42": "0003", "f4582f2": "0005"}


def test_there_is_a_fixture_for_each_schema_releases_made():
    assert FIXTURES == sorted(MADE_AT)
    assert all((RELEASES / f"{name}.sql").exists() for name in FIXTURES)


def load(url: str, release: str) -> None:
    """The release's database, as its dump has it, into url's fresh (empty) database."""
    if url.startswith("sqlite"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            conn.executescript((RELEASES / f"{release}.sql").read_text())
        return
    schema = url.rsplit("%3D", 1)[1]
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True,
                         options=f"-csearch_path={schema}") as conn:
        conn.execute((RELEASES / f"{release}.postgresql.sql").read_text().encode())


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainyard", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def values(engine, sql: str) -> list[tuple]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(sql))]


@pytest.mark.parametrize("release", FIXTURES)
def test_a_release_database_upgrades_and_keeps_working(release, backend_url):
    load(backend_url, release)
    engine = make_engine(backend_url)
    try:
        old_jobs, old_metrics = values(engine, JOBS), values(engine, METRICS)
        assert [j[2] for j in old_jobs] == ["succeeded", "running", "queued"] and len(old_metrics) == 3
        assert migrate.current(engine) == MADE_AT[release]
        assert migrate.upgrade(engine) == (MADE_AT[release], migrate.head())
        assert migrate.current(engine) == migrate.head()
        with engine.connect() as conn:  # exactly the tables this release declares, as on a new database
            assert compare_metadata(MigrationContext.configure(conn), metadata) == []
        assert values(engine, JOBS) == old_jobs and values(engine, METRICS) == old_metrics

        listed, total = job_reads.list_jobs(engine)
        assert total == 3 and [j.name for j in listed] == ["waiting", "running", "done"]
        assert job_reads.list_jobs(engine, max_bytes=1 << 20)[1] == 3
        done = job_reads.get_job(engine, 1)
        assert (done.state, done.epoch, done.result, done.artifact_path) == ("succeeded", 2, {"val_accuracy": 0.7},
                                                                              "artifacts/1/model.pt")
        assert [m["epoch"] for m in job_reads.get_metrics(engine, 1)] == [1, 2]

        claimed = queue.claim(engine, "new-worker", "cpu", 60.0)
        assert claimed is not None and (claimed.id, claimed.name, claimed.state) == (3, "waiting", "running")
        assert queue.succeed(engine, claimed.id, claimed.claim, {"val_accuracy": 0.9}, None)
        assert job_reads.get_job(engine, 3).state == "succeeded"
        assert migrate.upgrade(engine) == (migrate.head(), migrate.head())  # once is enough
    finally:
        engine.dispose()


@pytest.mark.slow
def test_the_first_release_database_upgrades_by_the_command_and_serves(tmp_path):
    """`trainyard db upgrade` on the first release's database (it lacks the baseline's plugin columns and
    an index), then the real server lists and shows its jobs (they were 503 "no such column" before)."""
    svc = Service(tmp_path / "data")
    (tmp_path / "data").mkdir(parents=True, exist_ok=True)
    load(f"sqlite:///{tmp_path / 'data' / 'trainyard.db'}", "617d61b")
    upgraded = cli(svc.env, "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    assert f"database schema: 0001 -> {migrate.head()}" in upgraded.stdout
    assert "added jobs.parameters, jobs.need_model" in upgraded.stderr
    svc.start_server()
    try:
        with svc.client() as c:
            page = c.get("/jobs")
            assert page.status_code == 200, page.text
            assert [j["name"] for j in page.json()["data"]] == ["waiting", "running", "done"]
            job = c.get("/jobs/1")
            assert job.status_code == 200 and job.json()["state"] == "succeeded"
            assert [m["epoch"] for m in c.get("/jobs/1/metrics").json()] == [1, 2]
    finally:
        svc.stop()


def test_a_database_no_release_made_is_refused_not_stamped(tmp_path):
    db = tmp_path / "data" / "trainyard.db"
    db.parent.mkdir()
    load(f"sqlite:///{db}", "617d61b")
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TABLE workers")
    engine = make_engine(f"sqlite:///{db}")
    try:
        with pytest.raises(SchemaUnknown, match="no table workers"):
            migrate.upgrade(engine)
        for command in (("serve",), ("db", "upgrade")):  # each stops, saying why in one line, no traceback
            refused = cli(Service(tmp_path / "data").env, *command)
            assert refused.returncode != 0 and "no release of trainyard since 617d61b made it" in refused.stderr
            assert "Traceback" not in refused.stderr, refused.stderr
        assert "alembic_version" not in {r[0] for r in values(engine, "SELECT name FROM sqlite_master")}
        assert [c[1] for c in values(engine, "PRAGMA table_info(jobs)")][-1] == "errors"  # nothing added
    finally:
        engine.dispose()


def test_postgres_fixtures_are_loaded_as_each_release_made_them():
    # the dumps keep each release's own PostgreSQL types and sequences (SERIAL ids): a new job gets the next id
    with postgres_schema("rel") as url:
        load(url, "617d61b")
        engine = make_engine(url)
        try:
            migrate.upgrade(engine)
            assert values(engine, "SELECT nextval('jobs_id_seq')") == [(4,)]
        finally:
            engine.dispose()
