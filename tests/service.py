"""The real service for integration tests: app.launcher's Service with test timings, on a free port."""
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainyard.app import launcher
from trainyard.app.client import TERMINAL  # noqa: F401 - re-exported for the tests
from trainyard.app.launcher import free_port  # noqa: F401 - re-exported for the tests

ROOT = Path(__file__).resolve().parents[1]  # the checkout: README, examples/, bench/

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
            worker_env: dict | None = None) -> Iterator[Service]:
    """A server on data_dir and `workers` CPU workers, all stopped on leaving, whatever happened (a module's
    shared service: `with serving(tmp_path_factory.mktemp(name) / "data") as svc: yield svc`)."""
    svc = Service(data_dir, env=env)
    try:
        svc.start_server()
        for _ in range(workers):
            svc.start_worker("cpu", env=worker_env)
        yield svc
    finally:
        svc.stop()


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
