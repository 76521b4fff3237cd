"""Shared fixtures: the service a test starts on a fresh data dir and database (`service`), a module's shared
one (`live`), databases on each backend, an S3 bucket; and the order the files run in (the longest first).
Plain helpers live in tests/helpers/."""
import pytest

from tests.helpers.backends import BACKENDS, fresh_database
from tests.helpers.s3 import new_bucket, s3_server
from tests.helpers.service import Service, live_service
from trainyard.app.db import make_engine, migrate
from trainyard.app.launcher import postgres_schema

# The longest modules (a full run's --durations, docs/layout.md "The suite's budget"), started first: xdist hands
# each process a file at a time, and a long file begun last runs alone while the other core idles (the torch
# floor's four minutes did, at the end of a 63-minute run). Then the other slow files, then the quick ones, whose
# many short files even out the end. `make test` runs xdist with --no-loadscope-reorder so that this order holds.
LONGEST = ("project/test_torch_floor.py", "fleet/test_slurm.py", "jobs/test_reliability.py", "cli/test_gpu_check.py",
           "worker/test_hosts_netns.py", "worker/test_multi_device.py", "api/test_api.py", "fleet/test_drain.py")


def pytest_collection_modifyitems(items):
    def module(item):
        return item.nodeid.split("::")[0].removeprefix("tests/")
    rank: dict[str, int] = {}
    for item in items:
        path = module(item)
        r = LONGEST.index(path) if path in LONGEST else len(LONGEST) + (0 if item.get_closest_marker("slow") else 1)
        rank[path] = min(r, rank.get(path, r))
    items.sort(key=lambda item: rank[module(item)])  # stable: a module's tests keep their order


# A module's own service, shared by its tests: a server and one CPU worker on SQLite. A module that needs
# another one says so in one line (`live = live_service(workers=0, env={...}, team=True)`, tests/helpers/service.py).
live = live_service()


@pytest.fixture
def service_backend():
    """The database of the `service` fixture. A module that runs its tests on both backends says
    `service_backend = on_both_backends()` (tests/helpers/backends.py)."""
    return "sqlite"


@pytest.fixture
def service(tmp_path, service_backend):
    """The real server on a fresh data dir and a fresh database: a SQLite file, or a PostgreSQL schema of
    the test's own (dropped afterwards)."""
    with fresh_database(service_backend) as url:
        svc = Service(tmp_path / "data", url).start_server()
        try:
            yield svc
        finally:
            svc.stop()


@pytest.fixture(params=BACKENDS)
def backend_url(request, tmp_path):
    """A database URL of each backend: a SQLite file, or a PostgreSQL schema of the test's own (so that
    tests never see each other's rows), dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'q.db'}"
        return
    with postgres_schema("t") as url:
        yield url


@pytest.fixture
def engine(backend_url):
    """An engine on backend_url's database (each backend), upgraded to this release's schema."""
    e = make_engine(backend_url)
    migrate.upgrade(e)
    yield e
    e.dispose()


@pytest.fixture(scope="session")
def s3_endpoint():
    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def bucket(s3_endpoint, monkeypatch):
    """A fresh bucket on the tests' own S3 server; this process's AWS_* variables point at it."""
    made = new_bucket(s3_endpoint)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    for k, v in made.env.items():
        monkeypatch.setenv(k, v)
    return made
