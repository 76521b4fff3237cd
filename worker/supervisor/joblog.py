"""A job's log, written by its supervisor alone and held to TRAINYARD_JOB_LOG_BYTES on disk.

The job process's stdout and stderr (Python's, a C extension's, its children's) are a pipe that
the supervisor copies here (JobOutput.pump), beside its own lines (attempt, stops, errors). A job that
prints without end (a progress bar per step) cannot grow the file past the cap: past it, the log
keeps its first quarter and its most recent output (between a half and three quarters of the
cap), with one line in between saying how many bytes were dropped. Each trim writes the new file
beside the old one and renames it over it, so a reader holding the log open reads a whole one.
Lines redrawn with carriage returns (tqdm's bars) keep only their last drawing. Torch-free.
"""
import fcntl
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from multiprocessing import connection
from multiprocessing.connection import Connection
from pathlib import Path

from trainyard.app.core.settings import Settings

log = logging.getLogger("trainyard.worker")

# A line's drawings before its last carriage return (one not ending the line: "\r\n" stays).
REDRAWN = re.compile(rb"[^\n\r]*\r(?=[^\n])")
MARK = re.compile(rb"\n\[trainyard: ([0-9,]+) bytes of output dropped here[^\n]*\]\n")
# A line still waiting for its newline is written out as it is past this many bytes.
LONGEST_PENDING = 64 << 10
COPY = 1 << 20
# The job's output is copied to its log at most this much per look at its pipe (the pipe holds 1 MiB).
PUMP_BYTES = 4 << 20


class CappedLog:
    def __init__(self, path: Path, cap: int):
        self.path, self.cap = Path(path), cap
        self.head, self.keep = cap // 4, cap // 2
        self.pending = b""  # the output's unfinished line (no newline yet), redrawings collapsed
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self.size = self.path.stat().st_size
        self.dropped, self.mark = self._read_mark()

    def _read_mark(self) -> tuple[int, int]:
        """A log this cap trimmed before (an earlier run of the job): bytes dropped, length of its line."""
        if self.size <= self.head:
            return 0, 0
        with open(self.path, "rb") as f:
            f.seek(self.head)
            m = MARK.match(f.read(400))
        return (int(m.group(1).replace(b",", b"")), len(m.group(0))) if m else (0, 0)

    def line(self, text: str) -> None:
        """One line of the supervisor's, after whatever the job printed so far."""
        self.finish_pending()
        self._write(text.rstrip("\n").encode("utf-8", "replace") + b"\n")

    def output(self, data: bytes) -> None:
        """Bytes from the job's stdout/stderr pipe."""
        data = self.pending + data
        end = data.rfind(b"\n") + 1
        whole, self.pending = data[:end], REDRAWN.sub(b"", data[end:])
        if len(self.pending) > LONGEST_PENDING:
            whole, self.pending = whole + self.pending, b""
        if whole:
            self._write(REDRAWN.sub(b"", whole) if b"\r" in whole else whole)

    def finish_pending(self) -> None:
        """The job's unfinished line, as it stands (its end, or a line of ours to follow)."""
        if self.pending:
            pending, self.pending = self.pending, b""
            self._write(pending.rstrip(b"\r") + b"\n")

    def _write(self, data: bytes) -> None:
        if self.size + len(data) > self.cap:
            return self._trim(data)
        with open(self.path, "ab") as f:
            f.write(data)
        self.size += len(data)

    def _trim(self, data: bytes) -> None:
        """The file becomes its head, the line saying what was dropped, and the last `keep` bytes of the
        output after the head (this data included; the earlier such line left out), from a line's start."""
        file_head = min(self.size, self.head)
        # The output so far as byte ranges of the file, the earlier trim's line left out, then data.
        parts = [(0, file_head), (file_head + self.mark, self.size)]
        total = self.size - self.mark + len(data)
        with open(self.path, "rb") as old:
            def blocks(lo: int, hi: int) -> Iterator[bytes]:
                pos = 0
                for a, b in parts:
                    s, e = max(lo, pos), min(hi, pos + b - a)
                    old.seek(a + s - pos)
                    while s < e:
                        block = old.read(min(COPY, e - s))
                        if not block:  # cannot happen while this is the log's only writer
                            break
                        s += len(block)
                        yield block
                    pos += b - a
                if hi > pos:
                    yield data[max(0, lo - pos):hi - pos]

            start = max(self.head, total - self.keep)
            newline = b"".join(blocks(start, min(total, start + LONGEST_PENDING))).find(b"\n")
            start += newline + 1
            self.dropped += start - self.head
            mark = (f"\n[trainyard: {self.dropped:,} bytes of output dropped here; the log keeps its first "
                    f"{self.head:,} bytes and its latest (TRAINYARD_JOB_LOG_BYTES={self.cap:,})]\n").encode()
            tmp = self.path.with_name(f".{self.path.name}.trim")
            with open(tmp, "wb") as new:
                for block in blocks(0, self.head):
                    new.write(block)
                new.write(mark)
                for block in blocks(start, total):
                    new.write(block)
                size = new.tell()
        os.replace(tmp, self.path)
        self.size, self.mark = size, len(mark)


def widen(pipe: Connection) -> None:
    """The output pipe's read end: non-blocking (the supervisor reads what is there), and as large as
    the host allows (up to 1 MiB), so a job printing fast waits less while the supervisor is busy."""
    os.set_blocking(pipe.fileno(), False)
    try:
        fcntl.fcntl(pipe.fileno(), 1031, 1 << 20)  # F_SETPIPE_SZ
    except OSError:
        pass  # past /proc/sys/fs/pipe-max-size: the default 64 KiB works, more slowly


class JobOutput:
    """A job's log as its supervisor keeps it: the supervisor's lines, what the job process prints (the
    non-blocking read end of its stdout/stderr pipe), and a copy in a bucket store whenever it changed."""

    def __init__(self, path: Path, settings: Settings, job_id: int, pipe: Connection | None):
        self.path, self.settings, self.job_id = path, settings, job_id
        self.log = CappedLog(path, settings.job_log_bytes)
        self.pipe = pipe                                # None once every writer is gone
        self.published: tuple[int, int] | None = None  # (size, mtime) of the log when last published

    def line(self, text: str) -> None:
        self.restore()
        self.log.line(text)

    def restore(self) -> None:
        """Fetch the log back from a bucket store if this host's copy was evicted while the job ran quiet
        (app/lifecycle/host_cache.py spares only copies younger than its grace period): the bucket's is the same, as
        the log is published whenever it changes. Appending to nothing would start it anew and overwrite it."""
        store = self.settings.store
        if store.remote and self.log.size and not self.path.exists():
            try:
                store.fetch(self.settings.layout.rel(self.path), refresh=True)
            except Exception as exc:
                log.warning("job %s: evicted log not fetched back from %s: %s", self.job_id, store.describe(), exc)

    def pump(self, limit: int = PUMP_BYTES) -> None:
        """Copy what the job (and every process it started) printed to its log, up to limit bytes."""
        self.restore()
        while limit > 0 and self.pipe is not None:
            try:
                data = os.read(self.pipe.fileno(), min(1 << 20, limit))
            except BlockingIOError:
                return
            if not data:  # every writer is gone
                self.log.finish_pending()
                self.pipe.close()
                self.pipe = None
                return
            self.log.output(data)
            limit -= len(data)

    def wait(self, conn: Connection, wait: float) -> bool:
        """Up to `wait` seconds for the job's next event on conn, copying its output meanwhile: True if one waits."""
        deadline = time.monotonic() + wait
        while self.pipe is not None:
            ready = connection.wait([conn, self.pipe], max(0.0, deadline - time.monotonic()))
            if self.pipe in ready:
                self.pump()
            if conn in ready or time.monotonic() >= deadline:
                break
        return conn.poll(max(0.0, deadline - time.monotonic()))

    def flush(self) -> None:
        """What the job printed so far, its unfinished line included."""
        self.pump()
        self.log.finish_pending()

    def tail(self, size: int = 16384) -> str:
        """The last `size` bytes of the log, the job process's last words included."""
        self.flush()
        try:
            with open(self.path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - size))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Once every process of the job is gone: the last of its output, and no more pipe."""
        self.pump()
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None
        self.log.finish_pending()

    def publish(self, allowed: Callable[[], bool] | None = None) -> None:
        """Copy the log to a bucket store when it changed (every heartbeat, and before the job's end is
        recorded), so that the API on any host serves it. A failed upload costs a stale log, not the job.
        allowed, asked only when there is something to copy: whether this run may still write it."""
        store = self.settings.store
        if not store.remote:
            return
        try:
            if not self.path.exists():
                return  # evicted unchanged since it was last published (restore() brings it back)
            stat = self.path.stat()
            if (stat.st_size, stat.st_mtime_ns) != self.published and (allowed is None or allowed()):
                store.publish(self.path)
                self.published = (stat.st_size, stat.st_mtime_ns)
        except Exception as exc:
            log.warning("job %s: log not published to %s: %s", self.job_id, store.describe(), exc)
