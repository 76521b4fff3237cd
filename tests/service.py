"""The real service for integration tests: app.launcher's Service with test timings, on a free port."""
from pathlib import Path

from trainyard.app import launcher
from trainyard.app.client import TERMINAL  # noqa: F401 - re-exported for the tests
from trainyard.app.launcher import ROOT, free_port  # noqa: F401 - re-exported for the tests

# Small timings so that lease expiry and recovery happen within a test's patience.
FAST_ENV = {"TRAINYARD_LEASE_S": "3", "TRAINYARD_HEARTBEAT_S": "0.5", "TRAINYARD_GRACE_S": "20"}


class Service(launcher.Service):
    """A server on a free port plus any number of workers, sharing one data dir and database."""

    def __init__(self, data_dir: Path, database_url: str = "", env: dict | None = None):
        base = launcher.Service.isolated(data_dir, database_url, {**FAST_ENV, **(env or {})})
        super().__init__(base.env, base.port, log_dir=data_dir)
        self.backend = "postgres" if database_url.startswith("postgresql") else "sqlite"
