"""Idle workers are woken by queue changes, at commit and not before, on SQLite (a datagram beside the
database) and PostgreSQL (LISTEN/NOTIFY), and a stop request interrupts their wait."""
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import insert

from tests.helpers.jobs import tiny_job
from trainyard.app.db import jobs, wakeup, write
from trainyard.app.fleet import workers
from trainyard.app.jobs import submit
from trainyard.app.spec import parse_spec


def later(seconds: float, fn) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        fn()

    t = threading.Thread(target=run)
    t.start()
    return t


def timed_wait(listener: wakeup.Listener, timeout: float) -> tuple[bool, float]:
    t0 = time.monotonic()
    woken = listener.wait(timeout)
    return woken, time.monotonic() - t0


def test_a_queue_change_wakes_an_idle_worker_at_once(engine):
    listener = wakeup.Listener(engine, "w1")
    try:
        assert timed_wait(listener, 0.3) == (False, pytest.approx(0.3, abs=0.15))  # nothing happens: it sleeps
        t = later(0.2, lambda: submit.enqueue(engine, parse_spec(tiny_job())))
        woken, waited = timed_wait(listener, 10)
        t.join()
        assert woken and waited < 2, waited
        assert listener.wait(0.2) is False  # one change, one wake-up: nothing left over
        workers.register_worker(engine, "w1", "h", 1, "cpu", {})
        t = later(0.2, lambda: workers.set_draining(engine, "w1", False))  # an undrain wakes it too
        assert listener.wait(10) is True
        t.join()
    finally:
        listener.close()


def test_no_wake_up_for_a_transaction_that_rolled_back(engine):
    listener = wakeup.Listener(engine, "w1")

    def aborted():
        with pytest.raises(RuntimeError):
            with write(engine) as conn:
                conn.execute(insert(jobs).values(kind="train", state="queued", spec={}, device_req="cpu", priority=0,
                                                 max_attempts=1, attempt=0, claim=0, created_at=0.0))
                wakeup.notify(conn)
                raise RuntimeError("abort")
    try:
        t = later(0.1, aborted)
        woken, _ = timed_wait(listener, 1.0)
        t.join()
        assert not woken
    finally:
        listener.close()


def test_a_stop_request_interrupts_the_wait(engine):
    listener = wakeup.Listener(engine, "w1")
    try:
        t = later(0.2, listener.interrupt)
        woken, waited = timed_wait(listener, 10)
        t.join()
        assert woken and waited < 2
    finally:
        listener.close()


@pytest.fixture
def short_dir():
    """A folder whose path leaves room for socket names beside a database in it (pytest's tmp_path under
    pytest-xdist does not: its sockets would go to /tmp instead)."""
    d = Path(tempfile.mkdtemp(prefix="ty-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_sqlite_senders_forget_the_sockets_of_workers_that_are_gone(short_dir):
    from trainyard.app.db import make_engine
    e = make_engine(f"sqlite:///{short_dir / 'q.db'}")
    folder = wakeup.sockets_dir(e)
    assert folder == short_dir / "q.db.wake"
    folder.mkdir()
    dead = folder / "123-abcdef.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(dead))  # bound, then closed: a worker killed without cleaning up
    live = wakeup.Listener(e, "w-live")
    try:
        with write(e) as conn:
            wakeup.notify(conn)
        assert not dead.exists() and live.wait(1.0)
    finally:
        live.close()
        e.dispose()
    assert list(folder.iterdir()) == []  # a listener that closes removes its socket
    deep = short_dir / ("x" * 120)
    assert str(wakeup.sockets_dir(make_engine(f"sqlite:///{deep / 'q.db'}"))).startswith("/tmp/trainyard-wake-")
