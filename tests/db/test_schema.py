"""Schema migrations: the migrations build the schema the code uses, on SQLite and PostgreSQL; the
data directory of the last release before migrations (tests/fixtures/release-8399c49, made by that
release's own code) upgrades with every job, metric and dataset intact and keeps working; a
PostgreSQL schema that is behind stops the server and workers with the command to run."""
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from tests.helpers.service import ROOT, Service
from trainyard.app.db import make_engine, metadata, migrate
from trainyard.app.launcher import postgres_schema

FIXTURE = Path(__file__).parents[1] / "fixtures" / "release-8399c49"


def test_the_migrations_build_the_schema_the_code_uses(backend_url):
    engine = make_engine(backend_url)
    try:
        assert migrate.current(engine) is None
        assert migrate.upgrade(engine) == (None, migrate.head())
        assert migrate.current(engine) == migrate.head()
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), metadata) == []
        assert migrate.upgrade(engine) == (migrate.head(), migrate.head())  # again: nothing to do
    finally:
        engine.dispose()


def rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchall()


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainyard", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_the_last_release_before_migrations_upgrades_with_everything_intact(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(FIXTURE, data)
    made = json.loads((data / "fixture.json").read_text())
    db = data / "trainyard.db"
    old_jobs = rows(db, "SELECT id, kind, name, state, spec, attempt, claim, artifact_path, result, errors FROM jobs "
                        "ORDER BY id")
    old_metrics = rows(db, "SELECT job_id, epoch, attempt, data FROM metrics ORDER BY job_id, epoch")
    assert len(old_jobs) == 6 and len(old_metrics) == 7 and not rows(db, "SELECT * FROM sqlite_master WHERE "
                                                                          "name = 'alembic_version'")
    svc = Service(data)
    assert "database schema: 0001; this trainyard: " in cli(svc.env, "db", "current").stdout
    upgraded = cli(svc.env, "db", "upgrade")
    assert upgraded.returncode == 0 and f"0001 -> {migrate.head()}" in upgraded.stdout, upgraded.stderr
    assert rows(db, "SELECT id, kind, name, state, spec, attempt, claim, artifact_path, result, errors FROM jobs "
                    "ORDER BY id") == old_jobs
    assert rows(db, "SELECT job_id, epoch, attempt, data FROM metrics ORDER BY job_id, epoch") == old_metrics

    # Today's server and worker on the upgraded directory: the old jobs, metrics, dataset and artifacts serve.
    svc.start_server()
    try:
        svc.start_worker("cpu")
        jobs = made["jobs"]
        with svc.client() as c:
            listed = c.get("/jobs?limit=50").json()["data"]
            assert {j["id"]: (j["name"], j["state"]) for j in listed} == {r[0]: (r[2], r[3]) for r in old_jobs}
            assert {j["name"]: j["state"] for j in listed if j["name"]} == {
                "on-upload": "succeeded", "iris": "succeeded", "diverges": "failed", "waits-for-a-gpu": "queued",
                "cancelled": "cancelled"}
            assert [m["epoch"] for m in c.get(f"/jobs/{jobs['iris']}/metrics").json()] == [1, 2, 3, 4]
            assert [d["id"] for d in c.get("/datasets").json()["data"]] == [made["dataset"].split(":", 1)[1]]
            assert c.get(f"/jobs/{jobs['iris']}/artifact").status_code == 200
            assert "no live worker serves device cuda" in c.get(f"/jobs/{made['queued']}").json()["waiting_for"]
        pred = svc.wait_state(svc.submit({"kind": "predict", "model_job": jobs["iris"], "device": "cpu",
                                          "inputs": [[5.1, 3.5, 1.4, 0.2]]})["id"])
        again = svc.wait_state(svc.submit({"kind": "train", "model": {"arch": "mlp", "hidden": [8]}, "device": "cpu",
                                           "data": {"dataset": made["dataset"]}, "train": {"epochs": 2}})["id"])
        assert pred["state"] == again["state"] == "succeeded", (pred["error"], again["error"])
    finally:
        svc.stop()


@pytest.mark.slow
def test_serve_upgrades_an_embedded_database_by_itself(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(FIXTURE, data)
    svc = Service(data).start_server()
    try:
        with svc.client() as c:
            assert c.get("/jobs").json()["count"] == 6
    finally:
        svc.stop()
    assert rows(data / "trainyard.db", "SELECT version_num FROM alembic_version") == [(migrate.head(),)]


@pytest.mark.postgres
@pytest.mark.slow
def test_a_postgres_schema_that_is_behind_stops_server_and_workers_naming_the_command(tmp_path):
    with postgres_schema("m") as url:
        engine = make_engine(url)
        migrate.upgrade(engine, to="0001")  # a database of an earlier release
        engine.dispose()
        svc = Service(tmp_path / "data", database_url=url)
        for args in (["serve"], ["worker", "--device", "cpu"]):
            refused = cli(svc.env, *args)
            assert refused.returncode != 0
            assert "schema is at revision 0001" in refused.stderr and "trainyard db upgrade" in refused.stderr
        assert cli(svc.env, "db", "upgrade").returncode == 0
        svc.start_server()
        try:
            with svc.client() as c:
                assert c.get("/healthz").status_code == 200
        finally:
            svc.stop()
