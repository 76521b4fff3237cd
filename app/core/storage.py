"""Where artifacts, checkpoints, uploads and job logs are kept: the data directory (the default) or an
S3-compatible bucket (TRAINYARD_STORAGE_URL=s3://bucket/prefix), so that hosts share them without NFS.

Keys are the data directory's relative paths (app/core/layout.py), e.g. "artifacts/7/run-2/model.safetensors".
Every process writes a file on its own disk first, under its data directory, then publishes it; a
process that needs a file another host wrote fetches it to the same place (the data directory doubles
as the cache of the bucket). With the data directory as the store, publishing and fetching cost nothing.

Why objects stay consistent without locks: every key but a job's log is written once (a run's files
carry its claim number, an upload its fresh id), and an S3 PUT is atomic (readers see the whole
object or none). A stale run writes only keys of its own run, and the database, updated fenced,
decides which checkpoint is resumed from; so no copy of a job can overwrite what another resumes from.

The client is boto3: the reference S3 client, spoken by AWS S3, MinIO, Cloudflare R2 and Ceph alike;
it reads the usual AWS_* variables (credentials, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL for a server other than AWS), uploads large files in parts from disk and downloads
them in chunks, so neither end holds a whole artifact in memory. Torch-free: the API uses it too.
"""
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from trainyard.app.core.errors import Unavailable
from trainyard.app.core.layout import Layout

CHUNK = 1 << 20


class Entry(NamedTuple):
    """One stored object: its key, size in bytes and when it was last written (epoch seconds)."""
    key: str
    size: int
    mtime: float


class Store:
    """The data directory as the store (TRAINYARD_STORAGE_URL unset): files are where they were written."""
    remote = False

    def __init__(self, layout: Layout):
        self.layout = layout

    def describe(self) -> str:
        return str(self.layout.root)

    def publish(self, path: Path) -> None:
        """Make a file written under the data directory readable by every host (here: it already is)."""

    def publish_dir(self, folder: Path) -> None:
        for path in sorted(p for p in Path(folder).rglob("*") if p.is_file() and not p.name.startswith(".")):
            self.publish(path)

    def fetch(self, key: str, refresh: bool = False) -> Path:
        """The local path of key, downloaded first where it is not here (or always, with refresh: a log
        grows). FileNotFoundError if the store has no such key."""
        path = self.layout.resolve(key)
        if not path.is_file():
            raise FileNotFoundError(key)
        return path

    def size(self, key: str) -> int:
        return self.fetch(key).stat().st_size

    def stream(self, key: str) -> Iterator[bytes]:
        """key's bytes in chunks; FileNotFoundError at once (before the first chunk) if it is missing."""
        f = open(self.fetch(key), "rb")

        def chunks() -> Iterator[bytes]:
            with f:
                while block := f.read(CHUNK):
                    yield block
        return chunks()

    def read_bytes(self, key: str) -> bytes:
        return b"".join(self.stream(key))

    def read_range(self, key: str, start: int = 0, last: int | None = None) -> tuple[int, int, Iterator[bytes]]:
        """(size, first, chunks): key's bytes from `start`, or its `last` bytes, streamed up to the size
        it had when opened (a file that grows gives its new bytes to the next read). FileNotFoundError at
        once if it is missing."""
        f = open(self.fetch(key), "rb")  # a file replaced meanwhile (a trimmed log) is read whole, the old one
        size = os.fstat(f.fileno()).st_size
        first = max(0, size - last) if last is not None else min(start, size)
        f.seek(first)

        def chunks() -> Iterator[bytes]:
            with f:
                left = size - first
                while left > 0 and (block := f.read(min(CHUNK, left))):
                    left -= len(block)
                    yield block
        return size, first, chunks()

    def keys(self, prefix: str) -> list[str]:
        return [e.key for e in self.entries(prefix)]

    def entries(self, prefix: str) -> list[Entry]:
        """Every object under prefix (a folder's key), with its size and age; what vanished meanwhile is left out."""
        found = []
        root = self.layout.resolve(prefix)
        for p in root.rglob("*") if root.is_dir() else ():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if p.is_file():
                found.append(Entry(self.layout.rel(p), st.st_size, st.st_mtime))
        return sorted(found)

    def delete(self, key: str) -> None:
        self.layout.resolve(key).unlink(missing_ok=True)

    def delete_keys(self, keys: list[str]) -> None:
        for key in keys:
            self.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self.layout.resolve(prefix), ignore_errors=True)


class S3Store(Store):
    """A bucket (and a key prefix in it) as the store; the data directory caches what was fetched."""
    remote = True

    def __init__(self, layout: Layout, bucket: str, prefix: str = ""):
        super().__init__(layout)
        self.bucket, self.prefix = bucket, prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._client: Any = None  # boto3's client (no type information), made per process
        self._pid: int | None = None
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def client(self) -> Any:
        # One client per process: a client made before a fork is not safe to use in the child.
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                import boto3
                from botocore.config import Config
                self._client = boto3.session.Session().client(
                    "s3", config=Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=10))
                self._pid = os.getpid()
            return self._client

    @contextmanager
    def _calling(self, key: str) -> Iterator[None]:
        """A missing key as FileNotFoundError; the store unreachable or refusing as Unavailable (503 at the
        API; an `infrastructure` failure, retried, in a job)."""
        from boto3.exceptions import Boto3Error  # S3Transfer's (a failed upload_file)
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            yield
        except (BotoCoreError, ClientError, Boto3Error) as exc:
            if _missing(exc):
                raise FileNotFoundError(key) from None
            raise Unavailable(f"object storage {self.describe()} failed on {key}: {type(exc).__name__}: "
                              f"{str(exc)[:300]}") from exc

    def _key(self, key: str) -> str:
        self.layout.resolve(key)  # refuses keys that would leave the data directory (and so the prefix)
        return self.prefix + str(key).lstrip("/")

    def publish(self, path: Path) -> None:
        # upload_file sends a large file in parts read from disk; the object appears only once complete.
        key = self.layout.rel(path)
        with self._calling(key):
            self.client.upload_file(str(path), self.bucket, self._key(key))

    def fetch(self, key: str, refresh: bool = False) -> Path:
        path = self.layout.resolve(key)
        if path.is_file() and not refresh:
            try:
                os.utime(path)  # used now: the last of this host's copies to go (app/lifecycle/host_cache.py)
                return path
            except FileNotFoundError:
                pass  # evicted just now: fetched again
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        os.close(fd)
        try:
            with self._calling(key):
                self.client.download_file(self.bucket, self._key(key), tmp)
            os.replace(tmp, path)  # whole or not at all, as the store's own copy
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def size(self, key: str) -> int:
        with self._calling(key):
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]

    def stream(self, key: str) -> Iterator[bytes]:
        with self._calling(key):
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]

        def chunks() -> Iterator[bytes]:
            with body:
                yield from body.iter_chunks(CHUNK)
        return chunks()

    def read_range(self, key: str, start: int = 0, last: int | None = None) -> tuple[int, int, Iterator[bytes]]:
        from botocore.exceptions import ClientError
        with self._calling(key):  # one GET: the object's size comes back in its Content-Range
            try:
                got = self.client.get_object(Bucket=self.bucket, Key=self._key(key),
                                             Range=f"bytes=-{last}" if last is not None else f"bytes={start}-")
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "InvalidRange":
                    raise
                got = None
        if got is None:  # start at or past the end (or an empty object)
            size = self.size(key)
            return size, min(start, size), iter(())
        span = got.get("ContentRange")  # "bytes 100-199/2000"; absent when the whole object came back
        size = int(span.rsplit("/", 1)[1]) if span else got["ContentLength"]
        first = int(span.split()[1].split("-")[0]) if span else 0
        body = got["Body"]

        def chunks() -> Iterator[bytes]:
            with body:
                yield from body.iter_chunks(CHUNK)
        return size, first, chunks()

    def entries(self, prefix: str) -> list[Entry]:
        full = self._key(prefix.rstrip("/") + "/")
        found = []
        with self._calling(prefix):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                found += [Entry(o["Key"][len(self.prefix):], o["Size"], o["LastModified"].timestamp())
                          for o in page.get("Contents", ())]
        return sorted(found)

    def delete(self, key: str) -> None:
        with self._calling(key):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        super().delete(key)  # and this host's cached copy

    def delete_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            with self._calling(keys[i]):
                self.client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": self._key(k)} for k in keys[i:i + 1000]], "Quiet": True})
        for key in keys:
            super().delete(key)  # and this host's cached copies

    def delete_prefix(self, prefix: str) -> None:
        self.delete_keys(self.keys(prefix))
        super().delete_prefix(prefix)


def _missing(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError
    return isinstance(exc, ClientError) and \
        exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")


def parse_url(url: str) -> tuple[str, str]:
    """s3://bucket/prefix -> (bucket, prefix); ValueError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme != "s3":
        raise ValueError(f"TRAINYARD_STORAGE_URL {url!r}: expected s3://bucket/prefix "
                         "(or unset, for the data directory)")
    if not parts.netloc:
        raise ValueError(f"TRAINYARD_STORAGE_URL {url!r}: names no bucket")
    return parts.netloc, parts.path.strip("/")


_stores: dict[tuple[str, str], Store] = {}


def open_store(url: str, layout: Layout) -> Store:
    """The store a storage URL names; one object per (url, data directory) in a process."""
    key = (url, str(layout.root))
    if key not in _stores:
        _stores[key] = S3Store(layout, *parse_url(url)) if url else Store(layout)
    return _stores[key]
