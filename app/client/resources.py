"""The client's resource namespaces — client.jobs, client.sweeps, client.datasets, client.workers, client.storage —
one verb meaning one thing on each: submit, get, list, cancel, wait, events, then what only one resource has.

Calling a namespace itself (`client.sweeps()`, `client.workers()`, `client.datasets()`) is the old spelling
of its list: it still answers what it did, with a DeprecationWarning naming the new call."""
from __future__ import annotations  # the verb `list` shadows the builtin in annotations

import builtins
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Generic
from urllib.parse import quote

import httpx

from trainyard.app.client.http import Http, unpack, until_ended
from trainyard.app.client.models import (
    Collection,
    Dataset,
    Event,
    Job,
    LogChunk,
    Page,
    R,
    StorageUsage,
    Sweep,
    Worker,
)
from trainyard.app.core.wire import NEXT_SINCE


def deprecated(old: str, new: str) -> None:
    """Warn the caller of an old spelling (two frames up: past the alias that calls this) of the new one."""
    warnings.warn(f"{old} is deprecated: use {new} (the old name goes in the next release)", DeprecationWarning,
                  stacklevel=3)


class Resource(Generic[R]):
    """One collection of the API (path, e.g. "/jobs") whose objects the client answers as `model` records."""
    path: str
    model: type[R]

    def __init__(self, http: Http):
        self._http = http

    def _one(self, method: str, suffix: str = "", **kw: Any) -> R:
        return self.model(self._http.json(method, self.path + suffix, **kw))

    def _page(self, **params: Any) -> Page[R]:
        return Page.of(self.model, self._http.json("GET", self.path, params=_given(params)))


class Runs(Resource[R]):
    """Jobs and sweeps: what is submitted, runs, and ends (succeeded, failed or cancelled)."""
    noun: str
    poll_s: float

    def submit(self, spec: dict[str, Any]) -> R:
        return self._one("POST", json=spec)

    def get(self, id: int) -> R:
        return self._one("GET", f"/{id}")

    def cancel(self, id: int) -> R:
        return self._one("POST", f"/{id}/cancel")

    def wait(self, id: int, timeout: float | None = None) -> R:
        """It, once it has ended (succeeded, failed or cancelled); TimeoutError after timeout seconds."""
        return until_ended(lambda: self.get(id), f"{self.noun} {id}", timeout, self.poll_s)

    def events(self, id: int, last_event_id: str | None = None) -> Iterator[Event]:
        """Its Server-Sent Events until it ends, the last one "end" (after a job's terminal state, which comes
        after every epoch). After a dropped connection, pass the last event's id to get only what came since;
        an id the stream cannot resume after is answered with a "reset" event and then the whole stream (drop
        what you had). Resuming after "end" gives no events. docs/api.md, Event streams, says it all."""
        return (Event(e) for e in self._http.events(f"{self.path}/{id}/events", last_event_id))


class Jobs(Runs[Job]):
    """client.jobs: train, predict and run jobs."""
    path, model, noun, poll_s = "/jobs", Job, "job", 0.25

    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> Job:
        """Queue a job; a retried submit with the same idempotency_key answers the first one's job."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._one("POST", json=spec, headers=headers)

    def submit_many(self, specs: builtins.list[dict[str, Any]]) -> builtins.list[Job]:
        """Queue several jobs at once (all or none), in order: a pipeline. A job names an earlier one of the list
        as "$N" (its position) in after, model_job or init_from, and waits for it to succeed."""
        return [Job(j) for j in self._http.json("POST", f"{self.path}/batch", json=specs)]

    def list(self, state: str | None = None, kind: str | None = None, sweep: int | None = None,
             include: str | None = None, limit: int | None = None, offset: int | None = None) -> Page[Job]:
        """A page of jobs, newest first: only those in `state` (queued, running, ...), of `kind` (train, predict,
        run), or trials of the sweep `sweep`; `limit` of them (the server's default 50, at most 500) from
        `offset`. include="spec,errors,result" adds what list items leave out."""
        return self._page(state=state, kind=kind, sweep=sweep, include=include, limit=limit, offset=offset)

    def retry(self, id: int) -> Job:
        """Queue a failed, cancelled or pruned job again (from its last checkpoint; a pruned trial runs to its end,
        outside its sweep's search)."""
        return self._one("POST", f"/{id}/retry")

    def delete(self, id: int) -> None:
        """Delete an ended job, its metrics and its files; APIError 409 names what keeps it (queued or running,
        pinned, named by a job that has not ended, the best trial of a running sweep)."""
        self._http.request("DELETE", f"{self.path}/{id}")

    def pin(self, id: int) -> Job:
        """Keep the job from deletion (its model is in use elsewhere) until unpin."""
        return self._one("POST", f"/{id}/pin")

    def unpin(self, id: int) -> Job:
        return self._one("POST", f"/{id}/unpin")

    def metrics(self, id: int, since: int = 0) -> builtins.list[dict[str, Any]]:
        """Every epoch record after `since`, oldest first, read a page at a time (the server bounds a page's bytes)."""
        out: builtins.list[dict[str, Any]] = []
        while True:
            r = self._http.request("GET", f"{self.path}/{id}/metrics", params={"since": since})
            page = r.json()
            out.extend(page)
            if NEXT_SINCE not in r.headers or not page:
                return out
            since = int(r.headers[NEXT_SINCE])

    def logs(self, id: int, tail: int | None = None) -> str:
        """The job's log, or its last `tail` bytes (from the first whole line in them)."""
        return self.read_log(id, tail=tail).data.decode("utf-8", "replace")

    def read_log(self, id: int, offset: int = 0, tail: int | None = None) -> LogChunk:
        """The log's bytes from `offset` (or its last `tail`). To follow a log, read again from start +
        len(data); a size below that means the log was trimmed (TRAINYARD_JOB_LOG_BYTES)."""
        params = {"tail": tail} if tail is not None else {"offset": offset} if offset else {}
        r = self._http.request("GET", f"{self.path}/{id}/logs", params=params)
        return LogChunk(r.content, int(r.headers.get("X-Log-Start", 0)),
                        int(r.headers.get("X-Log-Size", len(r.content))))

    def result(self, id: int) -> dict[str, Any]:
        """All of an ended job's result (predictions, evaluation, a run job's return value)."""
        return self._http.json("GET", f"{self.path}/{id}/result")

    def download(self, id: int, path: str | Path, format: str = "safetensors") -> Path:
        """Stream the job's artifact (format: safetensors, pt, meta, onnx, pt2, torchscript) to path, written
        whole or not at all."""
        return self._http.download(f"{self.path}/{id}/artifact", Path(path), {"format": format})

    def tensorboard(self, id: int, dest: str | Path) -> Path:
        """Download the job's TensorBoard event files into dest/<id>/ (replacing an earlier download's): that folder.
        With several jobs' in one dest, `tensorboard --logdir dest` shows a run per job. APIError 404: none."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        archive = self._http.download(f"{self.path}/{id}/tensorboard", dest / f".job-{id}-tensorboard.tar.gz", {})
        return unpack(archive, dest, str(id))


class Sweeps(Runs[Sweep]):
    """client.sweeps: hyperparameter sweeps, whose trials are jobs."""
    path, model, noun, poll_s = "/sweeps", Sweep, "sweep", 0.5

    def list(self, state: str | None = None, limit: int | None = None, offset: int | None = None) -> Page[Sweep]:
        """A page of sweeps, newest first, without their trials: only those in `state` (running, succeeded,
        failed, cancelled); `limit` of them (the server's default 50, at most 500) from `offset`."""
        return self._page(state=state, limit=limit, offset=offset)

    def trials(self, id: int) -> builtins.list[dict[str, Any]]:
        return self._http.json("GET", f"{self.path}/{id}/trials")

    def curves(self, id: int, since: int | None = None, limit: int | None = None) -> dict[str, Any]:
        """Every trial's metric per epoch: {"metric", "direction", "trials": [{"trial", "points": [[epoch, value]],
        ...}], "next", "more"}. With `since` (0, or a page's `next`), one page of the points recorded after it (at
        most `limit`); without, every page read and joined (an epoch recorded again keeps its last point)."""
        if since is not None:
            return self._http.json("GET", f"{self.path}/{id}/curves", params=_given({"since": since, "limit": limit}))
        page = self.curves(id, 0, limit)
        points = {t["trial"]: dict(t["points"]) for t in page["trials"]}
        while page["more"]:
            page = self.curves(id, page["next"], limit)
            for t in page["trials"]:
                points.setdefault(t["trial"], {}).update(dict(t["points"]))
        return {**page, "trials": [{**t, "points": [[e, v] for e, v in sorted(points.get(t["trial"], {}).items())]}
                                   for t in page["trials"]]}

    def delete(self, id: int, keep: str | None = None) -> None:
        """Delete an ended sweep and its trials' jobs (rows and files), all or none; keep="best" keeps the best
        trial's job (detached from the sweep). A running sweep, or a trial something keeps: APIError 409."""
        self._http.request("DELETE", f"{self.path}/{id}", params=_given({"keep": keep}))

    def __call__(self, **filters: Any) -> Page[Sweep]:
        deprecated("Client.sweeps()", "client.sweeps.list()")
        return self.list(**filters)


class Datasets(Resource[Dataset]):
    """client.datasets: your own data, named in jobs as upload:<id>."""
    path, model = "/datasets", Dataset

    def upload(self, path: str | Path, label_column: str | None = None) -> Dataset:
        """Upload a .csv (with label_column), .npz or ImageFolder .zip."""
        path = Path(path)
        data = {"label_column": label_column} if label_column is not None else None
        with open(path, "rb") as f:
            return self._one("POST", files={"file": (path.name, f)}, data=data,
                             timeout=httpx.Timeout(30, write=None, read=600))

    def get(self, id: str) -> Dataset:
        """One dataset by its id (the <id> of upload:<id>): its name, samples, shape and classes."""
        return self._one("GET", f"/{quote(id, safe='')}")

    def list(self) -> Page[Dataset]:
        """Every uploaded dataset (one page)."""
        return self._page()

    def delete(self, id: str) -> None:
        """Delete it; a queued job that names it fails when it starts."""
        self._http.request("DELETE", f"{self.path}/{quote(id, safe='')}")

    def __call__(self) -> Page[Dataset]:
        deprecated("Client.datasets()", "client.datasets.list()")
        return self.list()


class Workers(Resource[Worker]):
    """client.workers: the worker processes, by host and device."""
    path, model = "/workers", Worker

    def list(self, include_stopped: bool = False) -> Page[Worker]:
        """Every worker (one page: a fleet is small), stopped ones too with `include_stopped`."""
        found = self._http.json("GET", self.path, params={"include_stopped": "true"} if include_stopped else {})
        return Page.of(Worker, {"data": found, "count": len(found)})

    def drain(self, id: str) -> Worker:
        """The worker finishes what it runs and claims nothing more (until undrain)."""
        return self._one("POST", f"/{quote(id, safe='')}/drain")

    def undrain(self, id: str) -> Worker:
        return self._one("POST", f"/{quote(id, safe='')}/undrain")

    def __call__(self) -> builtins.list[Worker]:
        deprecated("Client.workers()", "client.workers.list()")
        return self.list().data


class Storage(Resource[StorageUsage]):
    """client.storage: what the store holds by kind, and its collector (the retention rules, then the objects no
    row references)."""
    path, model = "/storage", StorageUsage

    def get(self) -> StorageUsage:
        """The store's bytes and objects by kind as the collector last measured them, and the retention rules."""
        return self._one("GET")

    def collect(self) -> Collection:
        """Run the collector now (it also runs every TRAINYARD_COLLECT_S); what it removed, and the store after."""
        # A pass lists the whole store: a large bucket's takes longer than a request's usual 30 s.
        return Collection(self._http.json("POST", f"{self.path}/collect", timeout=httpx.Timeout(30, read=600)))


def _given(params: dict[str, Any]) -> dict[str, Any]:
    """The query parameters that have a value."""
    return {k: v for k, v in params.items() if v is not None}
