"""A real MLflow tracking server for the tests (`mlflow server`, SQLite backend, artifacts served from a folder,
on 127.0.0.1), which they stop and start again to play a tracker's outage, and read with MLflow's own client."""
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from trainyard.app.client.http import tls
from trainyard.app.launcher import free_port

MLFLOW = Path(sys.executable).with_name("mlflow")  # the console script of the test extra's mlflow


class MlflowServer:
    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        root.mkdir(parents=True, exist_ok=True)

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> "MlflowServer":
        """Serve (again, on the same port, database and artifacts); return once it answers /health."""
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root,
            env={**os.environ, "MLFLOW_TRACKING_URI": ""})
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.uri}/health", timeout=2, verify=tls()).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer within {timeout} s")

    def stop(self) -> None:
        """Stop it and every process it started (its session)."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # any worker process left behind
        except ProcessLookupError:
            pass
        self.proc = None

    def client(self):
        from mlflow.tracking import MlflowClient
        return MlflowClient(tracking_uri=self.uri)


@contextmanager
def mlflow_server(root: Path) -> Iterator[MlflowServer]:
    server = MlflowServer(root).start()
    try:
        yield server
    finally:
        server.stop()
