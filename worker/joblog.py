"""A job's log, written by its supervisor alone and held to TRAINYARD_JOB_LOG_BYTES on disk.

The job process's stdout and stderr (Python's, a C extension's, its children's) are a pipe that
the supervisor copies here (JobRun.pump), beside its own lines (attempt, stops, errors). A job that
prints without end (a progress bar per step) cannot grow the file past the cap: past it, the log
keeps its first quarter and its most recent output (between a half and three quarters of the
cap), with one line in between saying how many bytes were dropped. Each trim writes the new file
beside the old one and renames it over it, so a reader holding the log open reads a whole one.
Lines redrawn with carriage returns (tqdm's bars) keep only their last drawing. Torch-free.
"""
import os
import re
from pathlib import Path

# A line's drawings before its last carriage return (one not ending the line: "\r\n" stays).
REDRAWN = re.compile(rb"[^\n\r]*\r(?=[^\n])")
MARK = re.compile(rb"\n\[trainyard: ([0-9,]+) bytes of output dropped here[^\n]*\]\n")
# A line still waiting for its newline is written out as it is past this many bytes.
LONGEST_PENDING = 64 << 10
COPY = 1 << 20


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
            def blocks(lo: int, hi: int):
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
