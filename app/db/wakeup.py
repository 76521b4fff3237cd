"""Waking idle workers when the queue changes, so that they need not poll it often.

Every queue write that may give a worker something to do (a job queued, requeued or retried; a job
ended, which frees its device; a worker undrained) calls `notify(conn)` inside its transaction, and
idle workers wait on a `Listener` with a slow poll (seconds) as a safety net.

- PostgreSQL: a NOTIFY on the channel of the service's schema (`trainyard_queue_` and the md5 of
  `current_schema()`), which the database delivers at commit to every host's workers `LISTEN`ing on
  it. Channels are database-wide: one per schema keeps services that share a database in schemas of
  their own (and the tests, each in its schema) from waking each other's workers.
- SQLite (one host): once the transaction has committed (db.write calls `after_commit`), one
  datagram to each idle worker's UNIX socket in a directory beside the database file. A worker that
  is gone leaves a socket nobody reads: the sender removes it. Costs nothing while nothing happens.
"""
import hashlib
import os
import select
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

if TYPE_CHECKING:
    import psycopg

CHANNEL = "trainyard_queue_"
# The schema's channel, worked out by the database on both sides (a name within NAMEDATALEN whatever the schema's).
_CHANNEL_SQL = f"'{CHANNEL}' || md5(current_schema())"
_PENDING = "trainyard_wake"
# AF_UNIX paths hold at most 107 bytes: a database in a deep directory gets its sockets under /tmp.
_MAX_PATH = 100


def notify(conn: Connection) -> None:
    """Wake the idle workers once this transaction commits."""
    if conn.dialect.name == "postgresql":
        conn.execute(text(f"SELECT pg_notify({_CHANNEL_SQL}, '')"))
    else:
        conn.info[_PENDING] = True


def after_commit(conn: Connection, committed: bool) -> None:
    """db.write calls this when its transaction ends: SQLite's wake-ups go out only once committed, so
    that a worker woken by one sees the change."""
    if conn.info.pop(_PENDING, False) and committed:
        folder = sockets_dir(conn.engine)
        if folder is not None:
            _send_all(folder)


def sockets_dir(engine: Engine) -> Path | None:
    """Where a SQLite database's idle workers listen (None: not a file database)."""
    if engine.dialect.name != "sqlite" or not engine.url.database or engine.url.database == ":memory:":
        return None
    db = Path(engine.url.database).resolve()
    beside = db.parent / f"{db.name}.wake"
    if len(str(beside)) + 24 <= _MAX_PATH:
        return beside
    return Path("/tmp") / f"trainyard-wake-{hashlib.sha1(str(db).encode()).hexdigest()[:16]}"


def _send_all(folder: Path) -> None:
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        for name in names:
            path = folder / name
            try:
                s.sendto(b"!", str(path))
            except BlockingIOError:
                pass  # its queue of wake-ups is full: it is awake enough
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink(missing_ok=True)  # its worker is gone
            except OSError:
                pass


class Listener:
    """An idle worker's ear: wait(timeout) returns as soon as the queue changed, or after timeout."""

    def __init__(self, engine: Engine, name: str):
        self.engine, self.name = engine, name
        # interrupt() writes here (from a signal handler too): a worker told to stop stops waiting.
        self._interrupt_r, self._interrupt_w = os.pipe()
        os.set_blocking(self._interrupt_w, False)
        self._sock: socket.socket | None = None
        self._path: Path | None = None
        self._pg: psycopg.Connection | None = None
        if engine.dialect.name == "postgresql":
            self._listen_pg()
        else:
            folder = sockets_dir(engine)
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
                self._path = folder / f"{os.getpid()}-{name[-6:]}.sock"
                self._path.unlink(missing_ok=True)
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.bind(str(self._path))
                self._sock.setblocking(False)

    def _listen_pg(self) -> None:
        import psycopg
        # The engine's own connect arguments (its URL's options, a search_path among them), not the URL
        # rendered back to a string, which would mangle them.
        cargs, cparams = self.engine.dialect.create_connect_args(self.engine.url)
        try:
            self._pg = psycopg.connect(*cargs, **{**cparams, "autocommit": True})
            row = self._pg.execute(f"SELECT {_CHANNEL_SQL}").fetchone()
            assert row is not None
            self._pg.execute(f'LISTEN "{row[0]}"')
        except psycopg.Error:
            self._pg = None  # the database is away: poll until it is back

    def interrupt(self) -> None:
        try:
            os.write(self._interrupt_w, b"!")
        except OSError:
            pass  # already interrupted

    def wait(self, timeout: float) -> bool:
        """True when woken (or interrupted), False when the timeout passed first."""
        if self.engine.dialect.name == "postgresql" and self._pg is None:
            self._listen_pg()
        source = self._sock if self._sock is not None else self._pg
        ready, _, _ = select.select([self._interrupt_r] + ([source] if source is not None else []), [], [], timeout)
        if self._interrupt_r in ready:
            os.read(self._interrupt_r, 64)
        self._drain()
        return bool(ready)

    def _drain(self) -> None:
        """Consume what woke us: one wake-up is enough for any number of changes."""
        if self._sock is not None:
            try:
                while self._sock.recv(64):
                    pass
            except OSError:
                pass
        elif self._pg is not None:
            import psycopg
            try:
                for _ in self._pg.notifies(timeout=0.0):
                    pass
            except psycopg.Error:  # the connection broke (a restart, a failover): listen again next time
                self._pg.close()
                self._pg = None

    def close(self) -> None:
        os.close(self._interrupt_r)
        os.close(self._interrupt_w)
        if self._sock is not None:
            self._sock.close()
            if self._path is not None:
                self._path.unlink(missing_ok=True)
        if self._pg is not None:
            self._pg.close()
