"""The process launcher: `trainyard serve` and `trainyard worker` processes that share one data dir.

`trainyard up` runs the service with it; the tests and benchmarks start throwaway services on a
free port with Service.isolated(), and speak to them over HTTP like any client, on a database of their own:
a SQLite file in the data dir, or a throwaway schema of the local PostgreSQL (postgres_schema).
"""
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from trainyard.app.client import TERMINAL
from trainyard.app.client.http import tls
from trainyard.app.core import operator_token
from trainyard.app.core.ports import free_port

# The local PostgreSQL's `test` database, where the tests and benchmarks make their throwaway schemas.
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"


class Service:
    """A server on host:port plus any number of workers, stopped together."""

    def __init__(self, env: dict[str, str], port: int, host: str = "127.0.0.1", log_dir: Path | None = None):
        self.env, self.host, self.port = env, host, port
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        self.log_dir = log_dir  # None: the processes write to this terminal
        self.data_dir = Path(env.get("TRAINYARD_DATA_DIR", "./trainyard-data"))
        self.server: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    @classmethod
    def isolated(cls, data_dir: Path, database_url: str = "", env: dict | None = None) -> "Service":
        """A service of its own on a free port: none of this shell's TRAINYARD_* settings, logs in data_dir."""
        port = free_port()
        clean = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
        full = {**clean, "TRAINYARD_DATA_DIR": str(data_dir), "TRAINYARD_DATABASE_URL": database_url,
                "TRAINYARD_URL": f"http://127.0.0.1:{port}", "PYTHONUNBUFFERED": "1", **(env or {})}
        data_dir.mkdir(parents=True, exist_ok=True)
        return cls(full, port, log_dir=data_dir)

    def _spawn(self, args: list[str], name: str, env: dict | None = None,
               wrap: list[str] | None = None) -> subprocess.Popen:
        """`trainyard ARGS`, run through `wrap` when given (a command that execs the rest: the process keeps
        the pid Popen gives)."""
        out = None
        if self.log_dir is not None:
            log = self.log_dir / f"{name}.out"
            self.logs.append(log)
            out = open(log, "ab")
        return subprocess.Popen([*(wrap or []), sys.executable, "-m", "trainyard", *args],
                                env={**self.env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT if out else None)

    def start_server(self, wait: bool = True, log_level: str = "warning", processes: int = 1) -> "Service":
        self.server = server = self._spawn(["serve", "--host", self.host, "--port", str(self.port),
                                            "--log-level", log_level, "--workers", str(processes)], "server")
        if wait:
            self.wait_until(lambda: self._healthy(server), 60, "the server to answer /healthz")
        return self

    def _healthy(self, server: subprocess.Popen) -> bool:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with code {server.returncode}\n{self.output()}")
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1, verify=tls()).status_code == 200
        except httpx.TransportError:
            return False

    def start_worker(self, device: str = "cpu", wait: bool = True, env: dict | None = None,
                     extra: list[str] | None = None, wrap: list[str] | None = None) -> subprocess.Popen:
        """A worker process (run through `wrap`, say `ip netns exec NS`, when given); with wait, once it has
        registered with the database."""
        before = {w["id"] for w in self.client().get("/workers").json()} if wait else set()
        p = self._spawn(["worker", "--device", device, *(extra or [])], f"worker-{len(self.workers)}", env, wrap)
        self.workers.append(p)
        if wait:
            self.wait_until(lambda: any(w["pid"] == p.pid and w["id"] not in before
                                        for w in self.client().get("/workers").json()), 120, "worker registration")
        return p

    def client(self, **kw) -> httpx.Client:
        # A server listening beyond loopback with no token set makes one in its data dir (app/core/operator_token.py).
        token = self.env.get("TRAINYARD_API_TOKEN") or operator_token.read(self.data_dir)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, **{"timeout": 30, "headers": headers, "verify": tls(), **kw})

    def submit(self, body: dict, **kw) -> dict:
        with self.client() as c:
            r = c.post("/jobs", json=body, **kw)
        assert r.status_code in (200, 201), r.text
        return r.json()

    def job(self, job_id: int) -> dict:
        with self.client() as c:
            return c.get(f"/jobs/{job_id}").json()

    def wait_state(self, job_id: int, states=TERMINAL, timeout: float = 120, poll: float = 0.1) -> dict:
        """The job once in one of states, asked every `poll` s (a benchmark asks seldom: its questions cost the
        server CPU time the jobs it measures would use)."""
        states = (states,) if isinstance(states, str) else states
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while time.monotonic() < deadline:
                job = c.get(f"/jobs/{job_id}").json()
                if job["state"] in states:
                    return job
                time.sleep(poll)
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

    def supervise(self) -> int:
        """Until Ctrl-C or SIGTERM (0), or until one process exits (its exit code, or 1)."""
        stopping = False

        def stop(signum, frame):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        while not stopping:
            for p in self.processes():
                if p.poll() is not None:
                    what = "serve" if p is self.server else "worker"
                    print(f"trainyard: {what} exited with code {p.returncode}; stopping the rest", file=sys.stderr)
                    return p.returncode or 1
            time.sleep(0.2)
        return 0

    def processes(self) -> list[subprocess.Popen]:
        return [*([self.server] if self.server else []), *self.workers]

    def stop(self, grace_s: float = 30) -> None:
        """SIGTERM to every process (a paused one is resumed first), SIGKILL after grace_s."""
        procs = self.processes()
        for p in procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    p.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@contextmanager
def postgres_schema(prefix: str = "bench") -> Iterator[str]:
    """A fresh schema in the local PostgreSQL's `test` database, dropped afterwards: its database URL, for a
    throwaway service (tests and benchmarks) that must not see another's rows."""
    import psycopg  # here: `trainyard up` on SQLite never loads the driver
    name = f"{prefix}_{secrets.token_hex(4)}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {name}")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as c:
            c.execute(f"DROP SCHEMA {name} CASCADE")
