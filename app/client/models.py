"""What the client answers: the server's JSON objects as typed records (Job, Sweep, Dataset, Worker, Event,
StorageUsage, Collection; User, Project, IssuedToken, AuditEntry, Me), pages of them (Page), and a read of a
job's log (LogChunk).

A record is the JSON object as it came — a dict, so `job["state"]`, `json.dumps(job)` and `{**job}` work
as they always did — with typed attributes for the fields a caller reads most (`job.state`). Every other
field is there by key; the API reference (GET /docs) lists them all."""
from __future__ import annotations

from typing import Any, Generic, NamedTuple, TypeVar, cast, overload

T = TypeVar("T")


class Record(dict[str, Any]):
    """One JSON object from the server."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict.__repr__(self)})"


R = TypeVar("R", bound=Record)


class Field(Generic[T]):
    """A typed attribute that reads one key of its record (None where the server left the key out)."""

    def __init__(self, key: str):
        self.key = key

    @overload
    def __get__(self, record: None, owner: type) -> Field[T]: ...
    @overload
    def __get__(self, record: Record, owner: type) -> T: ...

    def __get__(self, record: Record | None, owner: type) -> Field[T] | T:
        return self if record is None else cast(T, record.get(self.key))


class Job(Record):
    __slots__ = ()
    id = Field[int]("id")
    kind = Field[str]("kind")
    name = Field[str | None]("name")
    state = Field[str]("state")
    progress = Field[dict[str, Any]]("progress")
    error = Field[dict[str, Any] | None]("error")
    result = Field[dict[str, Any] | None]("result")  # its summary; jobs.result(id) has all of it


class Sweep(Record):
    __slots__ = ()
    id = Field[int]("id")
    name = Field[str | None]("name")
    state = Field[str]("state")
    counts = Field[dict[str, int]]("counts")
    best = Field[dict[str, Any] | None]("best")
    error = Field[str | None]("error")
    trials = Field[list[dict[str, Any]] | None]("trials")  # by trial number; None in list pages and events


class Dataset(Record):
    __slots__ = ()
    id = Field[str]("id")
    dataset = Field[str]("dataset")  # what a job names it by: upload:<id>
    name = Field[str]("name")
    samples = Field[int]("samples")
    classes = Field[list[str]]("classes")


class Worker(Record):
    __slots__ = ()
    id = Field[str]("id")
    host = Field[str]("host")
    device = Field[str]("device")
    state = Field[str]("state")
    job_id = Field[int | None]("job_id")
    draining = Field[bool]("draining")


class StorageUsage(Record):
    """GET /storage: what the store holds, {kind: {"bytes", "objects"}}, as measured at measured_at (None
    before the collector's first pass), and the retention rules (durations in seconds, 0 keeps for ever). A
    member is shown their project's {"name", "bytes", "objects"} (project) instead: store None, kinds empty."""
    __slots__ = ()
    store = Field[str | None]("store")
    kinds = Field[dict[str, dict[str, int]]]("kinds")
    project = Field[dict[str, Any] | None]("project")
    measured_at = Field[str | None]("measured_at")
    rules = Field[dict[str, Any]]("rules")


class Collection(Record):
    """POST /storage/collect: what one pass of the collector removed, and the store after it (`usage`, by kind)."""
    __slots__ = ()
    took_s = Field[float]("took_s")
    deleted_objects = Field[int]("deleted_objects")
    deleted_bytes = Field[int]("deleted_bytes")
    usage = Field[dict[str, dict[str, int]]]("usage")
    measured_at = Field[str | None]("measured_at")


class User(Record):
    """A user (client.admin.users()): their projects and live tokens (ids and labels, never the tokens)."""
    __slots__ = ()
    id = Field[int]("id")
    name = Field[str]("name")
    admin = Field[bool]("admin")
    projects = Field[list[str]]("projects")
    tokens = Field[list[dict[str, Any]]]("tokens")


class Project(Record):
    """A project (client.admin.projects()): its share, limits and members."""
    __slots__ = ()
    id = Field[int]("id")
    name = Field[str]("name")
    share = Field[float]("share")
    limits = Field[dict[str, Any]]("limits")
    members = Field[list[str]]("members")


class IssuedToken(Record):
    """A token just issued: `token` is shown this once (the server keeps only its digest)."""
    __slots__ = ()
    id = Field[int]("id")
    token = Field[str]("token")
    user = Field[str]("user")
    project = Field[str | None]("project")
    expires_at = Field[str | None]("expires_at")  # ISO 8601; None: until revoked


class AuditEntry(Record):
    """One entry of the audit record: who (actor, in project) did what (action, target) when, from where."""
    __slots__ = ()
    id = Field[int]("id")
    at = Field[str]("at")
    actor = Field[str]("actor")
    action = Field[str]("action")
    target = Field[str | None]("target")
    client = Field[str | None]("client")


class Me(Record):
    """Who the client's token acts as (client.me())."""
    __slots__ = ()
    user = Field[str]("user")
    admin = Field[bool]("admin")
    project = Field[str | None]("project")


class Event(Record):
    """One Server-Sent Event: its name ("state", "epoch", "sweep", "trial", "end"), id and JSON data."""
    __slots__ = ()
    event = Field[str]("event")
    id = Field[str | None]("id")
    data = Field[Any]("data")


class Page(Record, Generic[R]):
    """A page of a list, newest first: `data` (the records), `count` (how many match, over all pages) and
    `next_offset` (the next page's offset where the server gives one; None on the last)."""
    __slots__ = ()

    @classmethod
    def of(cls, model: type[R], body: dict[str, Any]) -> Page[R]:
        return cls({**body, "data": [model(item) for item in body["data"]]})

    @property
    def data(self) -> list[R]:
        return self["data"]

    @property
    def count(self) -> int:
        return self["count"]

    @property
    def next_offset(self) -> int | None:
        return self.get("next_offset")


class LogChunk(NamedTuple):
    """A read of a job's log: its bytes, the byte they start at, and the log's size then."""
    data: bytes
    start: int
    size: int
