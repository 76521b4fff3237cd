"""The Python client of the REST API: the one HTTP layer the CLI and scripts use.

    from trainyard import Client
    c = Client()                                  # TRAINYARD_URL, TRAINYARD_API_TOKEN
    job = c.wait(c.submit(spec)["id"])
    c.download(job["id"], "model.safetensors")

Every method answers the JSON the server sends; an HTTP error raises APIError with its status
code and the server's detail.
"""
from __future__ import annotations  # the method `list` shadows the builtin in annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from trainyard.app import states

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


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0):
        self.url = (url or os.environ.get("TRAINYARD_URL") or "http://127.0.0.1:8000").rstrip("/")
        token = token if token is not None else os.environ.get("TRAINYARD_API_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise APIError(0, f"cannot reach trainyard at {self.url}: {exc}") from exc
        check(r)
        return r

    # -- jobs -------------------------------------------------------------------------------------

    def submit(self, spec: dict, idempotency_key: str | None = None) -> dict:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self.request("POST", "/jobs", json=spec, headers=headers).json()

    def get(self, job_id: int) -> dict:
        return self.request("GET", f"/jobs/{job_id}").json()

    def list(self, **filters) -> dict:
        """A page of jobs, newest first: {"data": [...], "count": n}; filters: state, kind, limit, offset."""
        return self.request("GET", "/jobs", params={k: v for k, v in filters.items() if v is not None}).json()

    def cancel(self, job_id: int) -> dict:
        return self.request("POST", f"/jobs/{job_id}/cancel").json()

    def retry(self, job_id: int) -> dict:
        return self.request("POST", f"/jobs/{job_id}/retry").json()

    def metrics(self, job_id: int, since: int = 0) -> list[dict]:
        """Every epoch record after `since`, oldest first, read a page at a time (the server bounds a page's bytes)."""
        out: list[dict] = []
        while True:
            r = self.request("GET", f"/jobs/{job_id}/metrics", params={"since": since})
            page = r.json()
            out.extend(page)
            if "X-Next-Since" not in r.headers or not page:
                return out
            since = int(r.headers["X-Next-Since"])

    def logs(self, job_id: int, tail: int | None = None) -> str:
        """The job's log, or its last `tail` bytes (from the first whole line in them)."""
        return self.read_log(job_id, tail=tail)[0].decode("utf-8", "replace")

    def read_log(self, job_id: int, offset: int = 0, tail: int | None = None) -> tuple[bytes, int, int]:
        """(data, start, size): the log's bytes from `offset` (or its last `tail`), the byte they start at
        and the log's size. To follow a log, read again from start + len(data); a size below that means
        the log was trimmed (TRAINYARD_JOB_LOG_BYTES)."""
        params = {"tail": tail} if tail is not None else {"offset": offset} if offset else {}
        r = self.request("GET", f"/jobs/{job_id}/logs", params=params)
        return r.content, int(r.headers.get("X-Log-Start", 0)), int(r.headers.get("X-Log-Size", len(r.content)))

    def result(self, job_id: int) -> dict:
        return self.request("GET", f"/jobs/{job_id}/result").json()

    def events(self, job_id: int, last_event_id: str | None = None) -> Iterator[dict]:
        """The job's Server-Sent Events until it ends: {"event": "state"|"epoch"|"end", "id": ..., "data": {...}}.
        After a dropped connection, pass the last event's id to get only what came since."""
        return self._stream_events(f"/jobs/{job_id}/events", last_event_id)

    def _stream_events(self, path: str, last_event_id: str | None) -> Iterator[dict]:
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        try:
            with self._http.stream("GET", path, headers=headers, timeout=httpx.Timeout(30, read=None)) as r:
                if r.is_error:
                    r.read()
                    check(r)
                yield from parse_sse(r.iter_lines())
        except httpx.TransportError as exc:
            raise APIError(0, f"cannot reach trainyard at {self.url}: {exc}") from exc

    def wait(self, job_id: int, timeout: float | None = None) -> dict:
        """The job once it has ended (succeeded, failed or cancelled); TimeoutError after timeout seconds."""
        return _until_ended(lambda: self.get(job_id), f"job {job_id}", timeout, 0.25)

    def download(self, job_id: int, path: str | Path, format: str = "safetensors") -> Path:
        """Stream a train job's artifact to path (written whole or not at all)."""
        out = Path(path)
        tmp = out.with_name(out.name + ".part")
        try:
            with self._http.stream("GET", f"/jobs/{job_id}/artifact", params={"format": format}) as r:
                if r.is_error:
                    r.read()
                    check(r)
                with open(tmp, "wb") as f:
                    for chunk in r.iter_bytes():
                        f.write(chunk)
        except httpx.TransportError as exc:
            tmp.unlink(missing_ok=True)
            raise APIError(0, f"cannot reach trainyard at {self.url}: {exc}") from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, out)
        return out

    # -- sweeps -----------------------------------------------------------------------------------

    def submit_sweep(self, spec: dict) -> dict:
        """Start a hyperparameter sweep: {"job": ..., "parameters": {"train.lr": {...}}, "method": ..., ...}."""
        return self.request("POST", "/sweeps", json=spec).json()

    def sweep(self, sweep_id: int) -> dict:
        """The sweep with its trials (by trial number)."""
        return self.request("GET", f"/sweeps/{sweep_id}").json()

    def sweeps(self, **filters) -> dict:
        """A page of sweeps, newest first, without their trials: {"data": [...], "count": n}; filters: state,
        limit, offset."""
        return self.request("GET", "/sweeps", params={k: v for k, v in filters.items() if v is not None}).json()

    def sweep_trials(self, sweep_id: int) -> list[dict]:
        return self.request("GET", f"/sweeps/{sweep_id}/trials").json()

    def sweep_curves(self, sweep_id: int, since: int | None = None, limit: int | None = None) -> dict:
        """Every trial's metric per epoch: {"metric", "direction", "trials": [{"trial", "points": [[epoch, value]],
        ...}], "next", "more"}. With `since` (0, or a page's `next`), one page of the points recorded after it (at
        most `limit`); without, every page read and joined (an epoch recorded again keeps its last point)."""
        if since is not None:
            return self.request("GET", f"/sweeps/{sweep_id}/curves",
                                params={"since": since, **({"limit": limit} if limit else {})}).json()
        page = self.sweep_curves(sweep_id, 0, limit)
        points = {t["trial"]: dict(t["points"]) for t in page["trials"]}
        while page["more"]:
            page = self.sweep_curves(sweep_id, page["next"], limit)
            for t in page["trials"]:
                points.setdefault(t["trial"], {}).update(dict(t["points"]))
        return {**page, "trials": [{**t, "points": [[e, v] for e, v in sorted(points.get(t["trial"], {}).items())]} for t in page["trials"]]}

    def cancel_sweep(self, sweep_id: int) -> dict:
        """Stop making trials and cancel the queued and running ones."""
        return self.request("POST", f"/sweeps/{sweep_id}/cancel").json()

    def sweep_events(self, sweep_id: int, last_event_id: str | None = None) -> Iterator[dict]:
        """The sweep's Server-Sent Events until it ends: "sweep" (the sweep without its trials) when it changes,
        "trial" (one trial) when a trial's state, epoch or value changes, then "end" {"id", "state"}."""
        return self._stream_events(f"/sweeps/{sweep_id}/events", last_event_id)

    def wait_sweep(self, sweep_id: int, timeout: float | None = None) -> dict:
        """The sweep once it has ended (succeeded, failed or cancelled); TimeoutError after timeout seconds."""
        return _until_ended(lambda: self.sweep(sweep_id), f"sweep {sweep_id}", timeout, 0.5)

    # -- the service ------------------------------------------------------------------------------

    def devices(self) -> dict:
        return self.request("GET", "/devices").json()

    def workers(self) -> list[dict]:
        return self.request("GET", "/workers").json()

    def drain(self, worker_id: str) -> dict:
        """The worker finishes what it runs and claims nothing more (until undrain)."""
        return self.request("POST", f"/workers/{quote(worker_id, safe='')}/drain").json()

    def undrain(self, worker_id: str) -> dict:
        return self.request("POST", f"/workers/{quote(worker_id, safe='')}/undrain").json()

    def catalog(self) -> dict:
        return self.request("GET", "/catalog").json()

    def upload(self, path: str | Path, label_column: str | None = None) -> dict:
        """Upload a dataset (.csv with label_column, .npz, ImageFolder .zip); name it in jobs as upload:<id>."""
        path = Path(path)
        data = {"label_column": label_column} if label_column is not None else None
        with open(path, "rb") as f:
            return self.request("POST", "/datasets", files={"file": (path.name, f)}, data=data,
                                timeout=httpx.Timeout(30, write=None, read=600)).json()

    def datasets(self) -> dict:
        return self.request("GET", "/datasets").json()


def check(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    try:
        detail = r.json().get("detail", r.text)
    except (ValueError, AttributeError):
        detail = r.text
    raise APIError(r.status_code, detail)


def parse_sse(lines: Iterator[str]) -> Iterator[dict]:
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


def _until_ended(read, what: str, timeout: float | None, poll_s: float) -> dict:
    """read() until what it returns has ended (a terminal state); TimeoutError after timeout seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        got = read()
        if got["state"] in TERMINAL:
            return got
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what} is still {got['state']} after {timeout} s")
        time.sleep(poll_s)
