"""The client's one HTTP layer: requests and their errors (APIError), Server-Sent Events, streamed downloads (an
archive's unpacked), and polling until a run ends. The resource namespaces (app/client/resources.py) speak only
through it."""
import functools
import json
import os
import shutil
import ssl
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from trainyard.app.core import states

TERMINAL = tuple(s.value for s in states.TERMINAL)


class APIError(Exception):
    """The server answered with an error status (or could not be reached: status_code 0)."""

    def __init__(self, status_code: int, detail: Any):
        self.status_code, self.detail = status_code, detail
        super().__init__(f"{status_code}: {describe(detail)}")


def describe(detail: Any) -> str:
    """A server's error detail as one line: validation errors become 'field.path: message; ...'."""
    if isinstance(detail, list):
        return "; ".join(f"{'.'.join(str(p) for p in d.get('loc', [])[1:]) or 'body'}: {d.get('msg')}"
                         if isinstance(d, dict) else str(d) for d in detail)
    return str(detail)


@functools.cache
def tls() -> ssl.SSLContext:
    """This process's one TLS context for its clients. httpx builds a new one for every Client it makes (loading
    certifi's bundle: about 45 ms of CPU), which a loop that makes a client per request, or per poll, pays each
    time; an SSLContext is safe to share between clients and threads."""
    return httpx.create_ssl_context()


class Http:
    """An httpx.Client that raises APIError for an error status or an unreachable server."""

    def __init__(self, url: str, token: str | None, timeout: float):
        self.url = url
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=url, headers=headers, timeout=timeout, verify=tls())

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self.client.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise self.unreachable(exc) from exc
        check(r)
        return r

    def json(self, method: str, path: str, **kw: Any) -> Any:
        return self.request(method, path, **kw).json()

    def unreachable(self, exc: Exception) -> APIError:
        return APIError(0, f"cannot reach trainyard at {self.url}: {exc}")

    def events(self, path: str, last_event_id: str | None) -> Iterator[dict[str, Any]]:
        """The Server-Sent Events at path until the server closes the stream (read without a read timeout)."""
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        try:
            with self.client.stream("GET", path, headers=headers, timeout=httpx.Timeout(30, read=None)) as r:
                if r.is_error:
                    r.read()
                    check(r)
                yield from parse_sse(r.iter_lines())
        except httpx.TransportError as exc:
            raise self.unreachable(exc) from exc

    def download(self, path: str, out: Path, params: dict[str, Any]) -> Path:
        """Stream the body at path to the file out, written whole or not at all."""
        tmp = out.with_name(out.name + ".part")
        try:
            with self.client.stream("GET", path, params=params) as r:
                if r.is_error:
                    r.read()
                    check(r)
                with open(tmp, "wb") as f:
                    for chunk in r.iter_bytes():
                        f.write(chunk)
        except httpx.TransportError as exc:
            tmp.unlink(missing_ok=True)
            raise self.unreachable(exc) from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, out)
        return out


def unpack(archive: Path, dest: Path, folder: str) -> Path:
    """Unpack the .tar.gz at archive (members under `folder`/) into dest/folder, replacing what was there, and
    delete the archive: dest/folder. Members that would land outside dest, links and devices are refused
    (tarfile's "data" filter)."""
    try:
        with tempfile.TemporaryDirectory(dir=dest, prefix=f".{folder}-") as tmp:
            with tarfile.open(archive) as tar:
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(tmp, filter="data")
                else:  # Python 3.11 before 3.11.4: the same refusals, by hand
                    for m in tar.getmembers():
                        if not (m.isfile() or m.isdir()) or m.name.startswith("/") or ".." in Path(m.name).parts:
                            raise ValueError(f"{archive.name}: {m.name!r} is a link or leaves {dest}: refused")
                    tar.extractall(tmp)  # every member checked above
            unpacked, target = Path(tmp) / folder, dest / folder
            unpacked.mkdir(exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(unpacked, target)
    finally:
        archive.unlink(missing_ok=True)
    return target


def check(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    try:
        detail = r.json().get("detail", r.text)
    except (ValueError, AttributeError):
        detail = r.text
    raise APIError(r.status_code, detail)


def parse_sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Server-Sent Events from text lines: each event's name, id and JSON data."""
    event: dict[str, Any] = {}
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield {"event": event.get("event", "message"), "id": event.get("id"),
                       "data": json.loads("\n".join(data))}
            event, data = {}, []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "data":
                data.append(value)
            elif field in ("event", "id"):
                event[field] = value


def until_ended(read: Callable[[], Any], what: str, timeout: float | None, poll_s: float) -> Any:
    """read() until what it returns has ended (a terminal state); TimeoutError after timeout seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        got = read()
        if got["state"] in TERMINAL:
            return got
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what} is still {got['state']} after {timeout} s")
        time.sleep(poll_s)
