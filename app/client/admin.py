"""client.admin: the admin surface of the API (/admin, admins' tokens only: anyone else gets APIError 403): users,
projects and their members, tokens issued and revoked, and the audit record."""
from typing import Any
from urllib.parse import quote

from trainyard.app.client.http import Http
from trainyard.app.client.models import AuditEntry, IssuedToken, Project, User


def _q(name: str) -> str:
    return quote(name, safe="")


class Admin:
    """client.admin: users(), add_user(name, admin=), set_admin(name, admin), delete_user(name), projects(),
    add_project(name, share=, limits=), set_project(name, share=, limits=), add_member(project, user),
    remove_member(project, user), issue_token(user, project=, label=, expires_in_s=), revoke_token(id),
    audit(limit=, before=, action=, actor=)."""

    def __init__(self, http: Http):
        self._http = http

    def users(self) -> list[User]:
        """Every user, with their projects and live tokens (ids and labels, never the tokens)."""
        return [User(u) for u in self._http.json("GET", "/admin/users")]

    def add_user(self, name: str, admin: bool = False) -> User:
        return User(self._http.json("POST", "/admin/users", json={"name": name, "admin": admin}))

    def set_admin(self, name: str, admin: bool) -> User:
        """Grant (True) or take back (False) the user's admin rights; taken back, their tokens that name no project
        are revoked."""
        return User(self._http.json("PATCH", f"/admin/users/{_q(name)}", json={"admin": admin}))

    def delete_user(self, name: str) -> dict[str, Any]:
        """Delete the user: their tokens are refused from the next request on, their memberships go, their jobs
        stay. What went: {"name", "projects", "tokens": [ids]}."""
        return self._http.json("DELETE", f"/admin/users/{_q(name)}")

    def projects(self) -> list[Project]:
        return [Project(p) for p in self._http.json("GET", "/admin/projects")]

    def add_project(self, name: str, share: float = 1.0, limits: dict[str, Any] | None = None) -> Project:
        """A new project; limits: devices, gpu_memory_gb, queued_jobs, running_sweeps, stored_bytes, max_priority
        (docs/teams.md)."""
        body = {"name": name, "share": share, "limits": limits or {}}
        return Project(self._http.json("POST", "/admin/projects", json=body))

    def set_project(self, name: str, share: float | None = None, limits: dict[str, Any] | None = None) -> Project:
        """Change its share, or its limits (merged: a key given replaces that limit, a key given None removes it)."""
        body: dict[str, Any] = {}
        if share is not None:
            body["share"] = share
        if limits is not None:
            body["limits"] = limits
        return Project(self._http.json("PATCH", f"/admin/projects/{_q(name)}", json=body))

    def add_member(self, project: str, user: str) -> Project:
        return Project(self._http.json("PUT", f"/admin/projects/{_q(project)}/members/{_q(user)}"))

    def remove_member(self, project: str, user: str) -> Project:
        """Take the user out of the project: their tokens for it are refused from the next request on."""
        return Project(self._http.json("DELETE", f"/admin/projects/{_q(project)}/members/{_q(user)}"))

    def issue_token(self, user: str, project: str | None = None, label: str | None = None,
                    expires_in_s: int | None = None) -> IssuedToken:
        """A new token for the user in the project (an admin's may name none), working for expires_in_s seconds
        (None: until revoked): its `token` is shown only now, with its `expires_at`."""
        return IssuedToken(self._http.json("POST", f"/admin/users/{_q(user)}/tokens",
                                           json={"project": project, "label": label, "expires_in_s": expires_in_s}))

    def revoke_token(self, id: int) -> None:
        """The token is refused from the next request on."""
        self._http.request("DELETE", f"/admin/tokens/{int(id)}")

    def audit(self, limit: int | None = None, before: int | None = None, action: str | None = None,
              actor: str | None = None) -> list[AuditEntry]:
        """The audit record, newest first: `limit` entries (the server's default 100) older than the id `before`,
        only those of `action` or by `actor` if given."""
        params = {k: v for k, v in {"limit": limit, "before": before, "action": action, "actor": actor}.items()
                  if v is not None}
        return [AuditEntry(e) for e in self._http.json("GET", "/admin/audit", params=params)]
