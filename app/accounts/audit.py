"""The audit record: who did what, when, from which client address; only ever appended to, read by admins.

Recorded are the actions that change what others see or hold: submitting, cancelling, retrying, deleting,
pinning jobs; sweeps' and datasets' equivalents; accounts (users, projects, members, tokens issued and revoked,
quota and share changes); preemptions. A record is written once the action has succeeded (a refused action
changed nothing; its 4xx is in the server's access log). Torch-free.
"""
import time
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.engine import Engine

from trainyard.app.accounts import Principal
from trainyard.app.db import audit, read, write

MAX_PAGE = 1000


def record(engine: Engine, who: Principal, action: str, target: str | None = None, client: str | None = None,
           detail: dict[str, Any] | None = None) -> None:
    with write(engine) as conn:
        conn.execute(insert(audit).values(at=time.time(), actor=who.user, project=who.project, action=action,
                                          target=target, detail=detail, client=client))


def entries(engine: Engine, limit: int = 100, before: int | None = None, action: str | None = None,
            actor: str | None = None) -> list[dict[str, Any]]:
    """The newest records first, `limit` of them, older than the id `before` when given."""
    query = select(audit).order_by(audit.c.id.desc()).limit(min(limit, MAX_PAGE))
    if before is not None:
        query = query.where(audit.c.id < before)
    if action is not None:
        query = query.where(audit.c.action == action)
    if actor is not None:
        query = query.where(audit.c.actor == actor)
    with read(engine) as conn:
        return [dict(r._mapping) for r in conn.execute(query)]
