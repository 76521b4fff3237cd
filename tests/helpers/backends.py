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


# A test of a module on both backends that runs on one of them: the scenario exercises the database no more than
# any other test does (a model's accuracy, a CLI's output, a worker-side file), or the other backend runs its
# twin elsewhere (tests/fleet/test_drain.py drains on both). The claim, the lease, fencing and SIGKILL recovery
# stay on both. Said once here so that the suite's time goes to what differs between the databases.
on_sqlite_only = pytest.mark.parametrize("service_backend", ["sqlite"])
on_postgres_only = pytest.mark.parametrize("service_backend", [pytest.param("postgres", marks=pytest.mark.postgres)])
