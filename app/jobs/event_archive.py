"""A job's TensorBoard event files (tensorboard/<job>/: worker/event_files.py writes them) as one .tar.gz, packed
from the store as it is read (GET /jobs/{id}/tensorboard): members <job>/<file>, so that unpacking archives of
several jobs into one folder gives `tensorboard --logdir` a run per job, named by its id.

It packs stored bytes and reads none of them: torch-free, and no tensorboard either. A file is read in chunks and
packed whole before the archive's bytes so far are handed out, so what is held is one file's compressed bytes at
most (event files are small: a few hundred bytes an epoch).
"""
import io
import tarfile
from collections.abc import Iterator

from trainyard.app.core.storage import Entry, Store


def event_files(store: Store, job_id: int) -> list[Entry]:
    """The job's event files in the store (every run's), temporaries left out; [] when it has none."""
    folder = store.layout.rel(store.layout.tensorboard(job_id))
    return [e for e in store.entries(folder) if not e.key.rpartition("/")[2].startswith(".")]


def archive(store: Store, job_id: int, entries: list[Entry]) -> Iterator[bytes]:
    """The .tar.gz of entries (the job's event files), in chunks. A file grown since it was listed is packed at its
    listed size (a run still writing); one gone since (the collector's) is left out."""
    folder = store.layout.rel(store.layout.tensorboard(job_id))
    out = _Drain()
    with tarfile.open(fileobj=out, mode="w|gz") as tar:
        for entry in entries:
            try:
                chunks = store.stream(entry.key)
            except FileNotFoundError:
                continue
            info = tarfile.TarInfo(f"{job_id}/{entry.key[len(folder) + 1:]}")
            info.size, info.mtime, info.mode = entry.size, int(entry.mtime), 0o644
            try:
                tar.addfile(info, _Reader(chunks, entry.size))
            finally:
                getattr(chunks, "close", lambda: None)()  # its file, read no further than its listed size
            yield out.take()
    yield out.take()


class _Drain(io.RawIOBase):
    """Where tarfile writes the archive: bytes kept until taken."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:  # type: ignore[override]  # tarfile hands bytes (its Buffer, really)
        self.parts.append(bytes(b))
        return len(b)

    def take(self) -> bytes:
        data = b"".join(self.parts)
        self.parts.clear()
        return data


class _Reader(io.RawIOBase):
    """A stored file's chunks as the file object tarfile reads, held to `size` bytes (zeros past a file that
    shrank, which an event file, only ever appended to, does not)."""

    def __init__(self, chunks: Iterator[bytes], size: int):
        self.chunks, self.left, self.buffer = chunks, size, b""

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        while len(self.buffer) < n:
            block = next(self.chunks, None)
            if block is None:
                self.buffer += bytes(n - len(self.buffer))
                break
            self.buffer += block
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        self.left -= len(data)
        return data
