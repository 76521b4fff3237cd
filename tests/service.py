"""Start the real service for integration tests: `trainyard serve` and `trainyard worker` as processes."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent

# Small timings so that lease expiry and recovery happen within a test's patience.
FAST_ENV = {"TRAINYARD_LEASE_S": "3", "TRAINYARD_HEARTBEAT_S": "0.5", "TRAINYARD_GRACE_S": "20"}

TERMINAL = ("succeeded", "failed", "cancelled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """A server on a free port plus any number of workers, sharing one data dir and database."""

    def __init__(self, data_dir: Path, database_url: str = "", env: dict | None = None):
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The developer's own TRAINYARD_* settings must not leak into tests.
        clean = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
        self.env = {**clean, **FAST_ENV, "TRAINYARD_DATA_DIR": str(data_dir),
                    "TRAINYARD_DATABASE_URL": database_url, "TRAINYARD_URL": self.url,
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        self.server: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        data_dir.mkdir(parents=True, exist_ok=True)

    def _spawn(self, args: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
        log = self.data_dir / f"{name}.out"
        self.logs.append(log)
        return subprocess.Popen([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env={**self.env, **(env or {})},
                                stdout=open(log, "ab"), stderr=subprocess.STDOUT)

    def start_server(self) -> "Service":
        self.server = self._spawn(["serve", "--port", str(self.port), "--log-level", "warning"], "server")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.server.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            time.sleep(0.1)
        raise RuntimeError(f"server did not come up: {self.output()}")

    def start_worker(self, device: str = "cpu", wait: bool = True, env: dict | None = None,
                     extra: list[str] | None = None) -> subprocess.Popen:
        before = {w["id"] for w in self.client().get("/workers").json()}
        p = self._spawn(["worker", "--device", device, *(extra or [])], f"worker-{len(self.workers)}", env)
        self.workers.append(p)
        if wait:
            self.wait_until(lambda: any(w["pid"] == p.pid and w["id"] not in before
                                        for w in self.client().get("/workers").json()), 120, "worker registration")
        return p

    def client(self, **kw) -> httpx.Client:
        token = self.env.get("TRAINYARD_API_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, timeout=30, headers=headers, **kw)

    def submit(self, body: dict, **kw) -> dict:
        with self.client() as c:
            r = c.post("/jobs", json=body, **kw)
        assert r.status_code in (200, 201), r.text
        return r.json()

    def job(self, job_id: int) -> dict:
        with self.client() as c:
            return c.get(f"/jobs/{job_id}").json()

    def wait_state(self, job_id: int, states=TERMINAL, timeout: float = 120) -> dict:
        states = (states,) if isinstance(states, str) else states
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while time.monotonic() < deadline:
                job = c.get(f"/jobs/{job_id}").json()
                if job["state"] in states:
                    return job
                time.sleep(0.1)
        raise AssertionError(f"job {job_id} not in {states} after {timeout}s: {job}\n{self.output()}")

    def wait_until(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}\n{self.output()}")

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in self.logs if p.exists())

    def stop(self) -> None:
        procs = [*self.workers, *([self.server] if self.server else [])]
        for p in procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    p.terminate()
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
