"""Who is asking: users, projects, their memberships and bearer tokens, and the Principal a request acts as.

A token is shown once, when issued ("tyk_" and 43 URL-safe characters: 256 random bits), and stored as its
SHA-256 digest only: a copy of the database gives no one a working token. With that much entropy a plain digest
is as strong as a slow password hash, and a request is checked with one indexed read. Each read is fresh, so a
revoked or expired token (expires_at, on the database clock), a user taken out of the project, a deleted user or
one whose admin rights were taken back is refused from the next request on.

A user's token names one project (the one its requests act in); an admin's may name none, and an admin sees
and acts on every project's jobs. TRAINYARD_API_TOKEN stays the operators' token: it acts as the admin `admin`.
With no TRAINYARD_API_TOKEN and no token sent, a request acts as that admin too, as before accounts (the
server then answers loopback only: app/api/guard.py). Torch-free.
"""
import hashlib
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, delete, false, insert, or_, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement

from trainyard.app.core.errors import Conflict, Invalid, NotFound
from trainyard.app.db import db_now, members, projects, read, sessions, tokens, users, write

PREFIX = "tyk_"
NAME = re.compile(r"[a-z][a-z0-9_.-]{0,99}")
ROOT = "admin"  # the name TRAINYARD_API_TOKEN (or an open loopback server) acts under
MAX_EXPIRES_S = 10 * 365 * 86400  # a token's lifetime may be given up to ten years


@dataclass(frozen=True)
class Principal:
    """Who a request acts as: a user, in a project (None: an admin acting across them)."""
    user: str
    admin: bool
    project_id: int | None = None
    project: str | None = None
    token_id: int | None = None

    def sees(self, project_id: int | None) -> bool:
        return self.admin or (project_id is not None and project_id == self.project_id)


ADMIN = Principal(ROOT, True)


def project_rows(table, who: Principal | None) -> ColumnElement[bool] | None:
    """The condition on a table of rows with a project_id (jobs, sweeps) that keeps those `who` may see; None:
    every row (an admin, or None: the service itself). Never `== None`: SQLAlchemy would make it IS NULL, the
    rows from before accounts, which only admins see."""
    if who is None or who.admin:
        return None
    return false() if who.project_id is None else table.c.project_id == who.project_id


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def authenticate(engine: Engine, token: str) -> Principal | None:
    """The principal a bearer token acts as, or None (unknown, revoked, expired, its user no longer in its
    project, or no longer an admin for a token that names no project)."""
    if not token.startswith(PREFIX):
        return None
    with read(engine) as conn:
        return principal_of(conn, digest(token))


def principal_of(conn: Connection, token_digest: str) -> Principal | None:
    """authenticate()'s check, by the token's digest (a dashboard session keeps only that: app/accounts/signins.py)."""
    member = and_(members.c.user_id == tokens.c.user_id, members.c.project_id == tokens.c.project_id)
    row = conn.execute(
        select(tokens.c.id, tokens.c.project_id, users.c.name, users.c.admin, projects.c.name.label("project"),
               members.c.user_id.label("member"))
        .join(users, users.c.id == tokens.c.user_id)
        .outerjoin(projects, projects.c.id == tokens.c.project_id)
        .outerjoin(members, member)
        .where(tokens.c.digest == token_digest, tokens.c.revoked_at.is_(None), unexpired())).first()
    if row is None or (row.project_id is not None and row.member is None and not row.admin):
        return None
    if row.project_id is None and not row.admin:
        return None
    return Principal(row.name, bool(row.admin), row.project_id, row.project, row.id)


def unexpired() -> ColumnElement[bool]:
    """The tokens whose expiry, if any, is still ahead on the database clock (one clock for every host)."""
    return or_(tokens.c.expires_at.is_(None), tokens.c.expires_at > db_now())


def _name(kind: str, name: str) -> str:
    if not NAME.fullmatch(name):
        raise Invalid(f"{kind} name {name!r}: lowercase letters, digits, '_', '.', '-', starting with a letter, "
                      "at most 100", loc=("name",))
    return name


def _insert(conn: Connection, table, values: dict[str, Any], what: str) -> int:
    try:
        with conn.begin_nested():
            return conn.execute(insert(table).values(**values).returning(table.c.id)).scalar_one()
    except IntegrityError:
        raise Conflict(f"{what} already exists") from None


def add_user(engine: Engine, name: str, admin: bool = False) -> dict[str, Any]:
    if _name("user", name) == ROOT:
        raise Conflict(f"user {ROOT!r} is TRAINYARD_API_TOKEN's")
    with write(engine) as conn:
        # The database's clock, as a sweep's created_at (sweep_reads.owner_of compares the two).
        user_id = _insert(conn, users, {"name": name, "admin": admin, "created_at": db_now()}, f"user {name!r}")
    return {"id": user_id, "name": name, "admin": admin, "projects": []}


def add_project(engine: Engine, name: str, share: float = 1.0, limits: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    with write(engine) as conn:
        project_id = _insert(conn, projects, {"name": _name("project", name), "share": share, "limits": limits or {},
                                              "created_at": time.time()}, f"project {name!r}")
    return {"id": project_id, "name": name, "share": share, "limits": limits or {}, "members": []}


def set_project(engine: Engine, name: str, share: float | None = None, limits: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if share is not None:
        values["share"] = share
    if limits is not None:
        values["limits"] = limits
    with write(engine) as conn:
        if values and not conn.execute(update(projects).where(projects.c.name == name).values(**values)).rowcount:
            raise NotFound(f"project {name!r} not found")
    return get_project(engine, name)


def _id(conn: Connection, table, name: str, what: str) -> int:
    found = conn.execute(select(table.c.id).where(table.c.name == name)).scalar()
    if found is None:
        raise NotFound(f"{what} {name!r} not found")
    return found


def add_member(engine: Engine, user: str, project: str) -> None:
    with write(engine) as conn:
        values = {"user_id": _id(conn, users, user, "user"), "project_id": _id(conn, projects, project, "project")}
        if conn.execute(select(members).filter_by(**values)).first() is None:
            conn.execute(insert(members).values(**values))


def remove_member(engine: Engine, user: str, project: str) -> None:
    with write(engine) as conn:
        gone = conn.execute(delete(members).where(members.c.user_id == _id(conn, users, user, "user"),
                                                  members.c.project_id == _id(conn, projects, project, "project")))
        if not gone.rowcount:
            raise NotFound(f"user {user!r} is not in project {project!r}")


def issue_token(engine: Engine, user: str, project: str | None, label: str | None = None,
                expires_in_s: int | None = None) -> dict[str, Any]:
    """A new token for the user in the project (an admin's may name none), working for expires_in_s seconds (None:
    until revoked): the token itself, shown only now."""
    if expires_in_s is not None and not 1 <= expires_in_s <= MAX_EXPIRES_S:
        raise Invalid(f"expires_in_s: 1 to {MAX_EXPIRES_S} seconds", loc=("expires_in_s",))
    token = PREFIX + secrets.token_urlsafe(32)
    with write(engine) as conn:
        expires_at = None if expires_in_s is None else conn.execute(select(db_now())).scalar_one() + expires_in_s
        row = conn.execute(select(users.c.id, users.c.admin).where(users.c.name == user)).first()
        if row is None:
            raise NotFound(f"user {user!r} not found")
        project_id = _id(conn, projects, project, "project") if project is not None else None
        if project_id is None and not row.admin:
            raise Invalid("a user's token names a project", loc=("project",))
        if project_id is not None and not row.admin and conn.execute(select(members).where(
                members.c.user_id == row.id, members.c.project_id == project_id)).first() is None:
            raise Conflict(f"user {user!r} is not in project {project!r}; add them first")
        token_id = _insert(conn, tokens, {"digest": digest(token), "user_id": row.id, "project_id": project_id,
                                          "label": label, "created_at": time.time(), "expires_at": expires_at},
                           "token")
    return {"id": token_id, "token": token, "user": user, "project": project, "label": label,
            "expires_at": expires_at}


def revoke_token(engine: Engine, token_id: int) -> None:
    """The token is refused from the next request on, and the dashboard sessions it signed in end with it."""
    with write(engine) as conn:
        revoked = conn.execute(update(tokens).where(tokens.c.id == token_id, tokens.c.revoked_at.is_(None))
                               .values(revoked_at=time.time()).returning(tokens.c.digest)).scalars().all()
        if not revoked:
            raise NotFound(f"no live token {token_id}")
        conn.execute(delete(sessions).where(sessions.c.token_digest.in_(revoked)))


def _not_self_or_root(name: str, actor: str, what: str) -> None:
    # ROOT is TRAINYARD_API_TOKEN's, not a row; an admin undoing themself would lock themself out by a typo:
    # another admin (or ROOT) may.
    if name == ROOT:
        raise Conflict(f"user {ROOT!r} is TRAINYARD_API_TOKEN's, not an account: change that variable instead")
    if name == actor:
        raise Conflict(f"an admin cannot {what} themself: another admin can")


def delete_user(engine: Engine, name: str, actor: str) -> dict[str, Any]:
    """Delete the user, their memberships and their tokens (refused from the next request on, their dashboard
    sessions ended). Their jobs, sweeps and datasets stay in their projects, `owner` still their name; the name
    is free again. What went: {"projects": [...], "tokens": [ids of those not revoked before]}."""
    _not_self_or_root(name, actor, "delete")
    with write(engine) as conn:
        user_id = _id(conn, users, name, "user")
        held = conn.execute(select(tokens.c.id, tokens.c.digest, tokens.c.revoked_at)
                            .where(tokens.c.user_id == user_id)).all()
        belongs = conn.execute(select(projects.c.name).join(members, members.c.project_id == projects.c.id)
                               .where(members.c.user_id == user_id).order_by(projects.c.name)).scalars().all()
        # Each row by hand, not by the foreign keys' cascade: a database of an earlier release may lack them.
        conn.execute(delete(sessions).where(sessions.c.token_digest.in_([t.digest for t in held])))
        conn.execute(delete(tokens).where(tokens.c.user_id == user_id))
        conn.execute(delete(members).where(members.c.user_id == user_id))
        conn.execute(delete(users).where(users.c.id == user_id))
    return {"projects": list(belongs), "tokens": [t.id for t in held if t.revoked_at is None]}


def set_admin(engine: Engine, name: str, admin: bool, actor: str) -> dict[str, Any]:
    """Grant or take back the user's admin rights. Taken back, their tokens that name no project (an admin's) are
    revoked, with their sessions; those of a project they are a member of act in it as a member from the next
    request on. What changed: {"admin": admin, "revoked": [token ids]}."""
    if not admin:
        _not_self_or_root(name, actor, "take admin rights from")
    elif name == ROOT:
        raise Conflict(f"user {ROOT!r} is TRAINYARD_API_TOKEN's, always an admin")
    with write(engine) as conn:
        user_id = _id(conn, users, name, "user")
        conn.execute(update(users).where(users.c.id == user_id).values(admin=admin))
        revoked: Sequence[Any] = ()
        if not admin:
            revoked = conn.execute(update(tokens).where(tokens.c.user_id == user_id, tokens.c.project_id.is_(None),
                                                        tokens.c.revoked_at.is_(None))
                                   .values(revoked_at=time.time()).returning(tokens.c.id, tokens.c.digest)).all()
            conn.execute(delete(sessions).where(sessions.c.token_digest.in_([t.digest for t in revoked])))
    return {"admin": admin, "revoked": [t.id for t in revoked]}


def list_users(engine: Engine) -> list[dict[str, Any]]:
    with read(engine) as conn:
        rows = conn.execute(select(users).order_by(users.c.id)).all()
        belongs = conn.execute(select(members.c.user_id, projects.c.name)
                               .join(projects, projects.c.id == members.c.project_id).order_by(projects.c.name)).all()
        live = conn.execute(select(tokens.c.id, tokens.c.user_id, tokens.c.label, tokens.c.created_at,
                                   tokens.c.expires_at, projects.c.name.label("project"))
                            .outerjoin(projects, projects.c.id == tokens.c.project_id)
                            .where(tokens.c.revoked_at.is_(None), unexpired()).order_by(tokens.c.id)).all()
    return [{"id": u.id, "name": u.name, "admin": bool(u.admin), "created_at": u.created_at,
             "projects": [b.name for b in belongs if b.user_id == u.id],
             "tokens": [{"id": t.id, "project": t.project, "label": t.label, "created_at": t.created_at,
                         "expires_at": t.expires_at} for t in live if t.user_id == u.id]} for u in rows]


def get_user(engine: Engine, name: str) -> dict[str, Any]:
    found = [u for u in list_users(engine) if u["name"] == name]
    if not found:
        raise NotFound(f"user {name!r} not found")
    return found[0]


def list_projects(engine: Engine) -> list[dict[str, Any]]:
    with read(engine) as conn:
        rows = conn.execute(select(projects).order_by(projects.c.id)).all()
        belongs = conn.execute(select(members.c.project_id, users.c.name)
                               .join(users, users.c.id == members.c.user_id).order_by(users.c.name)).all()
    return [{"id": p.id, "name": p.name, "share": p.share, "limits": p.limits or {}, "created_at": p.created_at,
             "members": [b.name for b in belongs if b.project_id == p.id]} for p in rows]


def get_project(engine: Engine, name: str) -> dict[str, Any]:
    found = [p for p in list_projects(engine) if p["name"] == name]
    if not found:
        raise NotFound(f"project {name!r} not found")
    return found[0]
