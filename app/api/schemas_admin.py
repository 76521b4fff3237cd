"""Wire types of the admin surface (app/api/routes/admin.py) and of GET /me: users, projects and their limits,
tokens, the audit record, and who a request acts as."""
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from trainyard.app.accounts import MAX_EXPIRES_S
from trainyard.app.accounts.project_limits import BOUNDS, MAX_SHARE
from trainyard.app.api.schemas import ErrorPublic

NAME = Field(max_length=100, description="lowercase letters, digits, '_', '.', '-', starting with a letter")
FORBIDDEN: dict[int | str, dict[str, Any]] = {403: {
    "model": ErrorPublic,
    "description": "the token is not an admin's (or, for a change, the request came from another web origin)"}}

# Each limit within its bound (app/accounts/project_limits.py): what the database and the SQL that uses it can hold.
Devices = Annotated[int, Field(ge=0, le=BOUNDS["devices"].most)]
QueuedJobs = Annotated[int, Field(ge=0, le=BOUNDS["queued_jobs"].most)]
RunningSweeps = Annotated[int, Field(ge=0, le=BOUNDS["running_sweeps"].most)]
StoredBytes = Annotated[int, Field(ge=0, le=BOUNDS["stored_bytes"].most)]
GpuMemoryGb = Annotated[float, Field(ge=0, le=BOUNDS["gpu_memory_gb"].most, allow_inf_nan=False)]
MaxPriority = Annotated[int, Field(ge=-1000, le=1000)]  # the range of a job's priority (app/spec/jobs.py)


class Limits(BaseModel):
    """A project's limits: only these keys, each a number >= 0 within its bound (app/accounts/project_limits.py: what
    the
    database and the claim's SQL can hold; null, in a PATCH, removes it), max_priority a priority (-1000..1000).
    devices and gpu_memory_gb hold its jobs back at the claim (app/fleet/fair_share.py), the others refuse its submits
    (app/accounts/quotas.py)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    devices: Devices | None = Field(None, description="devices its running jobs may hold at once")
    gpu_memory_gb: GpuMemoryGb | None = Field(None, description="GPU memory its running jobs may ask for at once, "
                                                                "in GB")
    queued_jobs: QueuedJobs | None = Field(None, description="jobs it may have queued")
    running_sweeps: RunningSweeps | None = Field(None, description="sweeps it may have running")
    stored_bytes: StoredBytes | None = Field(None, description="bytes its jobs' files may hold in the store")
    max_priority: MaxPriority | None = Field(None, description="the highest priority its members' jobs may ask for "
                                             "(unset: 0; admins' are never limited)")


# A field that grants rights is a strict boolean: "yes", 1 or "true" is a 422 naming it, never an admin.
ADMIN_RIGHTS = "sees and acts on every project, and on accounts"


class UserCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = NAME
    admin: StrictBool = Field(False, description=ADMIN_RIGHTS)


class UserUpdate(BaseModel):
    """PATCH /admin/users/{name}: grant (true) or take back (false) admin rights."""
    model_config = ConfigDict(extra="forbid")
    admin: StrictBool = Field(description=ADMIN_RIGHTS)


class UserDeleted(BaseModel):
    """What went with a deleted user: their memberships and tokens (their jobs, sweeps and datasets stay)."""
    name: str
    projects: list[str] = Field(description="the projects they were a member of")
    tokens: list[int] = Field(description="the ids of their tokens, refused from now on")


class TokenInfo(BaseModel):
    """A live token, without the token itself (only its digest is kept)."""
    id: int
    project: str | None
    label: str | None
    created_at: datetime
    expires_at: datetime | None = Field(None, description="when it stops working (null: when revoked)")


class UserPublic(BaseModel):
    id: int
    name: str
    admin: bool
    created_at: datetime | None = None
    projects: list[str] = Field(description="the projects they are a member of")
    tokens: list[TokenInfo] = Field([], description="their live tokens")


class ProjectCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = NAME
    share: float = Field(1.0, gt=0, le=MAX_SHARE, allow_inf_nan=False, description="its weight in the fair share")
    limits: Limits = Field(default_factory=Limits)


class ProjectUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    share: float | None = Field(None, gt=0, le=MAX_SHARE, allow_inf_nan=False)
    limits: Limits | None = Field(None, description="merged into its limits: a key given replaces that limit, a "
                                                    "key given as null removes it, a key left out stays")


class ProjectPublic(BaseModel):
    id: int
    name: str
    share: float
    limits: dict[str, Any]
    created_at: datetime | None = None
    members: list[str]
    stored_bytes: int | None = Field(None, description="GET /admin/projects: the bytes its jobs' and datasets' "
                                     "files held in the store at the collector's last pass (0 before the first)")


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    project: str | None = Field(None, max_length=100, description="the project its requests act in; an admin's "
                                                                  "may name none (acting across all)")
    label: str | None = Field(None, max_length=200, description="a note of where it is used")
    expires_in_s: int | None = Field(None, ge=1, le=MAX_EXPIRES_S, strict=True, description=(
        "it stops working this many seconds from now (on the database's clock); null: only when revoked"))


class TokenIssued(BaseModel):
    """A new token: `token` is shown now only (the server keeps its digest)."""
    id: int
    token: str
    user: str
    project: str | None
    label: str | None
    expires_at: datetime | None = Field(None, description="when it stops working (null: when revoked)")


class AuditEntry(BaseModel):
    id: int
    at: datetime
    actor: str = Field(description="the user who acted (admin: TRAINYARD_API_TOKEN)")
    project: str | None = Field(description="the project the actor acted in (null: an admin across them)")
    action: str
    target: str | None = Field(description='what it acted on: "job 7", "user ann", "token 3", "worker w1"...')
    detail: dict[str, Any] | None
    client: str | None = Field(description="the client's address")


class Me(BaseModel):
    """Who the request's token acts as."""
    user: str
    admin: bool
    project: str | None = Field(description="the project its requests act in (null: an admin across all)")
