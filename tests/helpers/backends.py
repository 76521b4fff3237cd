"""The databases a test runs on: SQLite always, PostgreSQL (marked `postgres`) where the test says both."""
from contextlib import AbstractContextManager, nullcontext

import pytest

from trainyard.app.launcher import postgres_schema

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def on_both_backends():
    """The `service_backend` fixture on both backends: a module says `service_backend = on_both_backends()`."""
    @pytest.fixture(params=BACKENDS, name="service_backend")
    def service_backend(request):
        return request.param
    return service_backend


def fresh_database(backend: str, prefix: str = "svc") -> AbstractContextManager[str]:
    """A database of its own for a service: "" (SQLite in the service's data directory) or, on "postgres", the
    URL of a PostgreSQL schema named after prefix, dropped on leaving."""
    return postgres_schema(prefix) if backend == "postgres" else nullcontext("")
