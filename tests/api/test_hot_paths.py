"""What the paths every client polls cost, as a count of SQL statements per request (issue 40): a page of
GET /jobs reads its rows and what its items share in a fixed number of statements, whatever the page's size, and
/healthz is one trivial query. Not a timed test: bench/api.py measures the time (docs/performance.md, "The list").

The real app (create_app, its lifespan and background duties) on a real SQLite file, called in this process
through httpx's ASGI transport so that every statement the request issues can be counted; the background duties'
threads are left out of the count."""
import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from trainyard.app.api import create_app
from trainyard.app.core.settings import Settings
from trainyard.app.fleet import workers as registry

TOKEN = "hot-paths-admin-token"
JOB = {"kind": "train", "model": {"arch": "mlp", "hidden": [8]}, "data": {"dataset": "iris"},
       "train": {"epochs": 1}, "device": "cuda:9"}  # no worker serves cuda:9: every job stays queued
# Statements a page of jobs may take, whatever its size: count, sizes, rows; the workers; the dependencies.
PAGE_STATEMENTS = 5
# The threads app/duties/loops.py runs its duties in: their statements are not the request's.
BACKGROUND = {"lease-reaper", "collector", "preemption", "sweeps", "dependencies"}


class Statements:
    """SQL statements issued by the request's own thread (not the server's background duties)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, conn, cursor, statement, parameters, context, executemany) -> None:
        if threading.current_thread().name not in BACKGROUND:
            self.seen.append(statement)

    @contextmanager
    def counting(self) -> Iterator[list[str]]:
        self.seen = []
        event.listen(Engine, "before_cursor_execute", self)
        try:
            yield self.seen
        finally:
            event.remove(Engine, "before_cursor_execute", self)


def serve(tmp_path: Path, scenario) -> None:
    """Run scenario(client, app) against the app on a fresh SQLite file, its lifespan around it."""
    settings = Settings(data_dir=tmp_path / "data", api_token=TOKEN, lease_s=3600)
    app = create_app(settings)

    async def main() -> None:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000",
                                         headers={"Authorization": f"Bearer {TOKEN}"}) as client:
                await scenario(client, app)
    asyncio.run(main())


@pytest.fixture
def statements() -> Statements:
    return Statements()


def test_a_page_of_jobs_costs_a_fixed_number_of_statements(tmp_path, statements):
    async def scenario(client: httpx.AsyncClient, app) -> None:
        registry.register_worker(app.state.engine, "w-cpu", "host", 1, "cpu", {})
        first = (await client.post("/jobs", json=JOB)).json()
        waits = set()
        for i in range(119):  # some wait on the first job too: their waiting_for names it
            made = (await client.post("/jobs", json={**JOB, "after": [first["id"]]} if i % 10 == 0 else JOB)).json()
            if i % 10 == 0:
                waits.add(made["id"])
        await client.get("/jobs?limit=200")  # each job's summary is read once per process: not what is counted
        counted = {}
        for limit in (10, 50, 200):
            with statements.counting() as seen:
                page = (await client.get(f"/jobs?limit={limit}")).json()
            counted[limit] = len(seen)
            assert len(page["data"]) == min(limit, 120) and page["count"] == 120
            waiting = {item["id"]: item["waiting_for"] for item in page["data"]}
            assert waiting == {job_id: f"what it waits for to succeed: job {first['id']} (queued)" if job_id in waits
                               else "no live worker serves device cuda:9" for job_id in waiting}
        assert counted[10] == counted[50] == counted[200] <= PAGE_STATEMENTS, counted
        # A page of ended jobs needs nothing its items share: its rows only.
        with statements.counting() as seen:
            done = (await client.get("/jobs?limit=50&state=succeeded")).json()
        assert done["data"] == [] and len(seen) <= 2, seen
    serve(tmp_path, scenario)


def test_a_page_within_its_byte_budget_reads_only_the_rows_it_keeps(tmp_path, statements):
    """include=spec past TRAINYARD_MAX_LIST_BYTES: the page ends early, in the same few statements."""
    big = {**JOB, "name": "big"}

    async def scenario(client: httpx.AsyncClient, app) -> None:
        app.state.settings.max_list_bytes = 3000
        for _ in range(30):
            assert (await client.post("/jobs", json=big)).status_code == 201
        with statements.counting() as seen:
            page = (await client.get("/jobs?limit=30&include=spec")).json()
        assert page["truncated"] and 1 <= len(page["data"]) < 30 and page["next_offset"] == len(page["data"])
        assert [item["id"] for item in page["data"]] == list(range(30, 30 - len(page["data"]), -1))
        assert all(item["spec"]["name"] == "big" for item in page["data"])
        assert len(seen) <= PAGE_STATEMENTS, seen
    serve(tmp_path, scenario)


def test_healthz_is_one_trivial_statement(tmp_path, statements):
    async def scenario(client: httpx.AsyncClient, app) -> None:
        await client.get("/healthz")
        with statements.counting() as seen:
            answer = await client.get("/healthz", headers={"Authorization": ""})
        assert answer.status_code == 200 and answer.json() == {"status": "ok"}
        assert [s.strip().upper() for s in seen] == ["SELECT 1"], seen
    serve(tmp_path, scenario)


def test_the_server_parses_http_and_runs_its_loop_in_c(tmp_path):
    """`trainyard serve` leaves uvicorn's choice on auto: httptools and uvloop when installed, which the project's
    dependencies make sure of (without them, h11 and asyncio's loop saturated the server on the list at 200
    requests/s: docs/performance.md)."""
    import uvicorn

    config = uvicorn.Config(create_app(Settings(data_dir=tmp_path)), http="auto", loop="auto")
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
    assert config.get_loop_factory().__module__.startswith("uvloop")
