"""The Python client of the REST API: the one HTTP layer the CLI and scripts use.

    from trainyard import Client
    with Client() as c:                                    # TRAINYARD_URL, TRAINYARD_API_TOKEN
        job = c.jobs.wait(c.jobs.submit(spec).id)
        c.jobs.download(job.id, "model.safetensors")

One namespace per resource — c.jobs, c.sweeps, c.datasets, c.workers, c.storage (app/client/resources.py), and
c.admin for admins (app/client/admin.py) — with one
verb meaning one thing on each (submit, get, list, cancel, wait, events, ...). They answer records
(app/client/models.py): the server's JSON as a dict, with typed attributes (job.state is job["state"]). An
HTTP error raises APIError with its status code and the server's detail.

The flat names of before (c.get, c.submit_sweep, c.workers(), ...) still work for one release and warn
(DeprecationWarning) naming the new call: DEPRECATED lists them.
"""
from __future__ import annotations  # the alias `list` shadows the builtin in annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from trainyard.app.client.admin import Admin
from trainyard.app.client.http import TERMINAL, APIError, Http, describe
from trainyard.app.client.models import Me
from trainyard.app.client.resources import Datasets, Jobs, Storage, Sweeps, Workers, deprecated
from trainyard.app.core import operator_token

__all__ = ["TERMINAL", "APIError", "Client", "describe"]


class _Alias:
    """An old flat name on Client that calls its new one (`get` -> `jobs.get`), warning each call."""

    def __init__(self, new: str):
        self.resource, self.verb = new.split(".")

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, client: Client | None, owner: type) -> Callable[..., Any]:
        if client is None:  # Client.get(client, 1), as an unbound method was called
            return lambda client, *args, **kw: self.__get__(client, owner)(*args, **kw)
        call = getattr(getattr(client, self.resource), self.verb)

        @functools.wraps(call)
        def alias(*args: Any, **kw: Any) -> Any:
            deprecated(f"Client.{self.name}()", f"client.{self.resource}.{self.verb}()")
            return call(*args, **kw)
        return alias


class Client:
    """A connection to one trainyard server; close it (or use `with`) to let its connections go.

    url defaults to TRAINYARD_URL (else http://127.0.0.1:8000), token to TRAINYARD_API_TOKEN (sent as a
    bearer token), timeout is each request's, in seconds. Each resource is a namespace:

    - client.jobs: submit(spec, idempotency_key=), get(id), list(state=, kind=, sweep=, include=, limit=,
      offset=), cancel(id), retry(id), delete(id), pin(id), unpin(id), wait(id, timeout=), events(id,
      last_event_id=), metrics(id, since=), logs(id, tail=), read_log(id, offset=, tail=), result(id),
      download(id, path, format=), tensorboard(id, dest), submit_many(specs)
    - client.sweeps: submit(spec), get(id), list(state=, limit=, offset=), cancel(id), delete(id, keep=),
      wait(id, timeout=), events(id, last_event_id=), trials(id), curves(id, since=, limit=)
    - client.datasets: upload(path, label_column=), get(id), list(), delete(id)
    - client.workers: list(include_stopped=), drain(id), undrain(id)
    - client.storage: get(), collect()
    - client.admin (admins' tokens): users(), add_user(name, admin=), projects(), add_project(name, share=,
      limits=), set_project(name, share=, limits=), add_member(project, user), remove_member(project, user),
      issue_token(user, project=, label=), revoke_token(id), audit(limit=, before=, action=, actor=)

    and the service as a whole: me(), devices(), catalog(), request(method, path, ...). They answer records
    (Job, Sweep, Dataset, Worker, Event; a list a Page of them); an error status raises APIError.
    """

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0):
        self.url = (url or os.environ.get("TRAINYARD_URL") or "http://127.0.0.1:8000").rstrip("/")
        token = token if token is not None else os.environ.get("TRAINYARD_API_TOKEN") or _stored_token(self.url)
        self._http = Http(self.url, token, timeout)
        self.jobs = Jobs(self._http)
        self.sweeps = Sweeps(self._http)
        self.datasets = Datasets(self._http)
        self.workers = Workers(self._http)
        self.storage = Storage(self._http)
        self.admin = Admin(self._http)

    def close(self) -> None:
        self._http.client.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """Any request to the API (path from its root), an error status raised as APIError."""
        return self._http.request(method, path, **kw)

    # -- the service as a whole: not resources, so not in a namespace --------------------------------

    def me(self) -> Me:
        """Who the token acts as: {user, admin, project} (GET /me)."""
        return Me(self._http.json("GET", "/me"))

    def devices(self) -> dict[str, Any]:
        """CUDA and its versions, each GPU with its workers, the CPU and its workers (GET /devices)."""
        return self._http.json("GET", "/devices")

    def catalog(self) -> dict[str, Any]:
        """The built-in and plugin models, datasets, entrypoints and the job spec's schemas (GET /catalog)."""
        return self._http.json("GET", "/catalog")

    # -- deprecated flat names (client.sweeps(), .workers() and .datasets() warn in their namespaces) ----

    submit = _Alias("jobs.submit")
    get = _Alias("jobs.get")
    list = _Alias("jobs.list")
    cancel = _Alias("jobs.cancel")
    retry = _Alias("jobs.retry")
    wait = _Alias("jobs.wait")
    events = _Alias("jobs.events")
    metrics = _Alias("jobs.metrics")
    logs = _Alias("jobs.logs")
    read_log = _Alias("jobs.read_log")
    result = _Alias("jobs.result")
    download = _Alias("jobs.download")
    submit_sweep = _Alias("sweeps.submit")
    sweep = _Alias("sweeps.get")
    sweep_trials = _Alias("sweeps.trials")
    sweep_curves = _Alias("sweeps.curves")
    cancel_sweep = _Alias("sweeps.cancel")
    sweep_events = _Alias("sweeps.events")
    wait_sweep = _Alias("sweeps.wait")
    upload = _Alias("datasets.upload")
    drain = _Alias("workers.drain")
    undrain = _Alias("workers.undrain")


# Old name -> new call, for the docs and the tests.
DEPRECATED = {name: f"{a.resource}.{a.verb}" for name, a in vars(Client).items() if isinstance(a, _Alias)} | {
    "sweeps": "sweeps.list", "workers": "workers.list", "datasets": "datasets.list"}


def _stored_token(url: str) -> str | None:
    """The admin token a server made in its data directory (app/core/operator_token.py), for a client on the same
    machine (`docker compose exec api trainyard jobs`): read only when the URL is this machine's loopback, so
    that the token never travels to another host."""
    if not operator_token.loopback(urlsplit(url).hostname or ""):
        return None
    return operator_token.read(Path(os.environ.get("TRAINYARD_DATA_DIR") or "./trainyard-data"))
