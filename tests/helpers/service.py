"""The real service for integration tests: app.launcher's Service with test timings, on a free port."""
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers.backends import fresh_database
from tests.helpers.teams import make_team
from trainyard.app import launcher
from trainyard.app.client import TERMINAL  # noqa: F401 - re-exported for the tests
from trainyard.app.launcher import free_port  # noqa: F401 - re-exported for the tests

ROOT = Path(__file__).resolve().parents[2]  # the checkout: README, examples/, bench/

# Small timings so that lease expiry and recovery happen within a test's patience.
FAST_ENV = {"TRAINYARD_LEASE_S": "3", "TRAINYARD_HEARTBEAT_S": "0.5", "TRAINYARD_GRACE_S": "20"}


class Service(launcher.Service):
    """A server on a free port plus any number of workers, sharing one data dir and database."""

    def __init__(self, data_dir: Path, database_url: str = "", env: dict | None = None):
        base = launcher.Service.isolated(data_dir, database_url, {**FAST_ENV, **(env or {})})
        super().__init__(base.env, base.port, log_dir=data_dir)
        self.backend = "postgres" if database_url.startswith("postgresql") else "sqlite"


@contextmanager
def serving(data_dir: Path, workers: int = 1, env: dict | None = None,
            worker_env: dict | None = None, database_url: str = "") -> Iterator[Service]:
    """A server on data_dir (and database_url's database, if given) and `workers` CPU workers, all stopped on
    leaving, whatever happened."""
    svc = Service(data_dir, database_url, env=env)
    try:
        svc.start_server()
        for _ in range(workers):
            svc.start_worker("cpu", env=worker_env)
        yield svc
    finally:
        svc.stop()


def live_service(workers: int = 1, env: dict | None = None, worker_env: dict | None = None,
                 backends: list | None = None, team: bool = False):
    """A module's `live` fixture: one service for the whole module, `workers` CPU workers, env over the server's
    and the workers' settings (worker_env over the workers' alone), on SQLite or, with backends=BACKENDS, once on
    each database; with team=True it is (service, its team: tests.helpers.teams.make_team). A module whose
    service differs from tests/conftest.py's `live` says so in one line: `live = live_service(workers=0, ...)`."""
    @pytest.fixture(scope="module", name="live", params=backends)
    def live(request, tmp_path_factory):
        name = request.module.__name__.rpartition(".")[2]
        with fresh_database(getattr(request, "param", "sqlite"), name) as url, \
                serving(tmp_path_factory.mktemp(name) / "data", workers, env, worker_env, url) as svc:
            yield (svc, make_team(svc)) if team else svc
    return live


def metrics(service, job_id) -> list[dict]:
    """A job's epochs as GET /jobs/{id}/metrics lists them."""
    with service.client() as c:
        return c.get(f"/jobs/{job_id}/metrics").json()


def wait_checkpoint(service, job_id, epoch: int) -> dict:
    """The job once it has checkpointed `epoch` (or a later one)."""
    service.wait_until(lambda: (service.job(job_id)["checkpoint_epoch"] or 0) >= epoch, 120,
                       f"job {job_id} to checkpoint epoch {epoch}")
    return service.job(job_id)


def probe_plugin(root: Path, module: str, source: str, entrypoints: tuple[str, ...]) -> Path:
    """A plugin of `run` entrypoints written to root (a module plus its dist-info, found by importlib.metadata
    as an installed package's would be): put root on a worker's PYTHONPATH to install it there."""
    (root / f"{module}.py").write_text(source)
    dist = root / f"{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[trainyard.entrypoints]\n" + "".join(
        f"{name} = {module}:{name}\n" for name in entrypoints))
    return root


def run_job(entrypoint: str, **config) -> dict:
    """A `run` job of entrypoint on the CPU."""
    return {"kind": "run", "entrypoint": entrypoint, "device": "cpu", "config": config}
