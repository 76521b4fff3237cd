"""Shared fixtures: a fresh data dir per test, the live service, tiny job presets."""
from contextlib import AbstractContextManager, nullcontext

import pytest

from bench.common import postgres_schema
from tests.s3 import new_bucket, s3_server
from tests.service import Service
from trainyard.app.db import make_engine, migrate
from trainyard.app.spec import TRAIN_EXAMPLE

# The README's Iris job (seed 000's MLP and loop settings), as the OpenAPI docs show it.
IRIS_JOB = TRAIN_EXAMPLE


def tiny_job(epochs: int = 2, **train) -> dict:
    """A job that takes well under a second to train."""
    return {"kind": "train", "model": {"arch": "mlp", "hidden": [8]}, "data": {"dataset": "iris"},
            "train": {"epochs": epochs, "batch_size": 32, **train}, "device": "cpu"}


def slow_job(epochs: int = 40, **train) -> dict:
    """A job that trains for several seconds and checkpoints every epoch (for crash tests)."""
    return {"kind": "train", "model": {"arch": "cnn", "channels": [16, 32]}, "data": {"dataset": "digits"},
            "train": {"epochs": epochs, "batch_size": 16, "lr": 0.001, "checkpoint_every_s": 0, **train},
            "device": "cpu"}


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture
def service_backend():
    """The database of the `service` fixture. A module that runs its tests on both backends says
    `service_backend = on_both_backends()`."""
    return "sqlite"


def on_both_backends():
    @pytest.fixture(params=BACKENDS, name="service_backend")
    def service_backend(request):
        return request.param
    return service_backend


def fresh_database(backend: str, prefix: str = "svc") -> AbstractContextManager[str]:
    """A database of its own for a service: "" (SQLite in the service's data directory) or, on "postgres", the
    URL of a PostgreSQL schema named after prefix, dropped on leaving."""
    return postgres_schema(prefix) if backend == "postgres" else nullcontext("")


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
