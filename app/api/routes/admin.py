"""The admin surface: users, projects (their share and limits), memberships, tokens and the audit record, under
/admin and for admins only (403 to anyone else); and GET /me, for any token: who it acts as.

Each change is recorded in the audit record once it has succeeded (app/accounts/audit.py), with the admin who made it
and the client's address. The work is app/accounts/__init__.py's; these routes check, call and record."""
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import Response

from trainyard.app import accounts
from trainyard.app.accounts import audit
from trainyard.app.api.deps import AdminDep, EngineDep, WhoDep, client_address, require_admin
from trainyard.app.api.schemas import responses, ts
from trainyard.app.api.schemas_admin import (
    FORBIDDEN,
    AuditEntry,
    Me,
    ProjectCreate,
    ProjectPublic,
    ProjectUpdate,
    TokenCreate,
    TokenIssued,
    UserCreate,
    UserDeleted,
    UserPublic,
    UserUpdate,
)
from trainyard.app.lifecycle import project_storage
from trainyard.app.spec import MAX_ID

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)], responses=FORBIDDEN)
me_router = APIRouter(tags=["admin"])

ProjectName = Annotated[str, Path(max_length=100, description="a project's name")]
UserName = Annotated[str, Path(max_length=100, description="a user's name")]

TokenId = Annotated[int, Path(ge=1, le=MAX_ID, description="a token's id, as GET /admin/users lists it")]
NO_PROJECT = responses(not_found="no such project")
NO_USER_OR_PROJECT = responses(not_found="no such user or project")


def _record(request: Request, who: accounts.Principal, action: str, target: str, detail: dict | None = None) -> None:
    audit.record(request.app.state.engine, who, action, target, client_address(request), detail)


@me_router.get("/me", response_model=Me, operation_id="whoami")
async def whoami(who: WhoDep) -> Me:
    """Who the request's token acts as: its user, whether an admin, and the project its requests act in."""
    return Me(user=who.user, admin=who.admin, project=who.project)


@router.get("/users", response_model=list[UserPublic], operation_id="list_users")
def list_users(engine: EngineDep) -> list[dict]:
    """Every user, with their projects and live tokens (never the tokens themselves)."""
    return accounts.list_users(engine)


@router.post("/users", response_model=UserPublic, status_code=201, operation_id="add_user",
             responses=responses(conflict="a user of that name exists"))
def add_user(body: UserCreate, request: Request, engine: EngineDep, who: AdminDep) -> dict:
    """A new user (in no project yet: PUT /admin/projects/{name}/members/{user} adds them to one)."""
    made = accounts.add_user(engine, body.name, body.admin)
    _record(request, who, "user_add", f"user {body.name}", {"admin": body.admin})
    return made


NOT_ROOT_OR_SELF = responses(not_found="no such user",
                             conflict="the user is `admin` (TRAINYARD_API_TOKEN's) or the admin asking")


@router.patch("/users/{name}", response_model=UserPublic, operation_id="update_user", responses=NOT_ROOT_OR_SELF)
def update_user(name: UserName, body: UserUpdate, request: Request, engine: EngineDep, who: AdminDep) -> dict:
    """Grant (admin: true) or take back (false) a user's admin rights. Taken back, their tokens that name no
    project are revoked (with their dashboard sessions); a token of a project they are a member of acts in it as
    a member's from the next request on, and their other tokens are refused. Not of `admin`, nor of yourself."""
    changed = accounts.set_admin(engine, name, body.admin, who.user)
    _record(request, who, "user_set", f"user {name}", changed)
    return accounts.get_user(engine, name)


@router.delete("/users/{name}", response_model=UserDeleted, operation_id="delete_user", responses=NOT_ROOT_OR_SELF)
def delete_user(name: UserName, request: Request, engine: EngineDep, who: AdminDep) -> dict:
    """Delete a user: their tokens are refused from the next request on (their dashboard sessions end), their
    memberships go. Their jobs, sweeps and datasets stay in their projects, `owner` still their name; the name may
    be given to a new user. Not `admin`, nor yourself."""
    gone = accounts.delete_user(engine, name, who.user)
    _record(request, who, "user_delete", f"user {name}", gone)
    return {"name": name, **gone}


@router.get("/projects", response_model=list[ProjectPublic], operation_id="list_projects")
def list_projects(engine: EngineDep) -> list[dict]:
    """Every project, with what its files held in the store at the collector's last pass (stored_bytes)."""
    stored = project_storage.stored(engine)
    return [{**p, "stored_bytes": stored.get(p["id"], 0)} for p in accounts.list_projects(engine)]


@router.post("/projects", response_model=ProjectPublic, status_code=201, operation_id="add_project",
             responses=responses(conflict="a project of that name exists"))
def add_project(body: ProjectCreate, request: Request, engine: EngineDep, who: AdminDep) -> dict:
    """A new project, with its share of the fleet and its limits (devices, gpu_memory_gb, queued_jobs,
    running_sweeps, stored_bytes, max_priority): a job over one waits or is refused at submit, never fails
    (docs/teams.md)."""
    limits = body.limits.model_dump(exclude_none=True)
    made = accounts.add_project(engine, body.name, body.share, limits)
    _record(request, who, "project_add", f"project {body.name}", {"share": body.share, "limits": limits})
    return made


@router.patch("/projects/{name}", response_model=ProjectPublic, operation_id="update_project",
              responses=NO_PROJECT)
def update_project(name: ProjectName, body: ProjectUpdate, request: Request, engine: EngineDep,
                   who: AdminDep) -> dict:
    """Change a project's share or limits. Limits are merged: a key given replaces that limit, a key given as
    null removes it, a key left out stays. A job over a limit waits or is refused at submit (docs/teams.md)."""
    limits = None
    if body.limits is not None:
        given = body.limits.model_dump(exclude_unset=True)
        merged = {**accounts.get_project(engine, name)["limits"], **given}
        limits = {k: v for k, v in merged.items() if v is not None}
    changed = accounts.set_project(engine, name, body.share, limits)
    _record(request, who, "project_set", f"project {name}",
            {k: v for k, v in (("share", body.share), ("limits", limits)) if v is not None})
    return changed


@router.put("/projects/{name}/members/{user}", response_model=ProjectPublic, operation_id="add_member",
            responses=NO_USER_OR_PROJECT)
def add_member(name: ProjectName, user: UserName, request: Request, engine: EngineDep, who: AdminDep) -> dict:
    """Make the user a member of the project (again is no change): their tokens for it may then be issued."""
    accounts.add_member(engine, user, name)
    _record(request, who, "member_add", f"project {name}", {"user": user})
    return accounts.get_project(engine, name)


@router.delete("/projects/{name}/members/{user}", response_model=ProjectPublic, operation_id="remove_member",
               responses=responses(not_found="no such user or project, or the user is not in it"))
def remove_member(name: ProjectName, user: UserName, request: Request, engine: EngineDep, who: AdminDep) -> dict:
    """Take the user out of the project: their tokens for it are refused from the next request on."""
    accounts.remove_member(engine, user, name)
    _record(request, who, "member_remove", f"project {name}", {"user": user})
    return accounts.get_project(engine, name)


@router.post("/users/{name}/tokens", response_model=TokenIssued, status_code=201, operation_id="issue_token",
             responses={**NO_USER_OR_PROJECT, **responses(conflict="the user is not in that project")})
def issue_token(name: UserName, body: TokenCreate, request: Request, engine: EngineDep, who: AdminDep) -> dict:
    """A new token for the user, acting in the project (an admin's may name none). The token is in this answer
    only: the server keeps its digest. It works at once, until DELETE /admin/tokens/{id} or, given expires_in_s,
    until then (expires_at)."""
    made = accounts.issue_token(engine, name, body.project, body.label, body.expires_in_s)
    _record(request, who, "token_issue", f"token {made['id']}",
            {"user": name, "project": body.project, "label": body.label, "expires_at": made["expires_at"]})
    return made


@router.delete("/tokens/{token_id}", status_code=204, response_class=Response, operation_id="revoke_token",
               responses=responses(not_found="no live token of that id"))
def revoke_token(token_id: TokenId, request: Request, engine: EngineDep, who: AdminDep) -> Response:
    """Revoke a token: it is refused (401) from the next request on, and the dashboard sessions it signed in end."""
    accounts.revoke_token(engine, token_id)
    _record(request, who, "token_revoke", f"token {token_id}")
    return Response(status_code=204)


@router.get("/audit", response_model=list[AuditEntry], operation_id="list_audit")
def list_audit(engine: EngineDep,
               limit: Annotated[int, Query(ge=1, le=audit.MAX_PAGE)] = 100,
               before: Annotated[int | None, Query(ge=1, le=MAX_ID, description=(
                   "only entries older than this id (the next page: the last entry's id)"))] = None,
               action: Annotated[str | None, Query(max_length=32)] = None,
               actor: Annotated[str | None, Query(max_length=100)] = None) -> list[AuditEntry]:
    """Who did what, when, from which address: newest first, `limit` entries."""
    return [AuditEntry(**{**e, "at": ts(e["at"])}) for e in audit.entries(engine, limit, before, action, actor)]
