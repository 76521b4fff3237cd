"""Users, projects, tokens and the audit record (app/accounts/__init__.py, app/accounts/audit.py) on both databases:
a token is
stored as its digest only, acts as its user in its project, and stops working the moment it is revoked or its
user leaves the project; names are checked; the audit record reads newest first."""
import pytest
from sqlalchemy import select

from trainyard.app import accounts
from trainyard.app.accounts import audit
from trainyard.app.core.errors import Conflict, Invalid, NotFound
from trainyard.app.db import read, tokens


def test_a_token_acts_as_its_user_in_its_project_until_revoked(engine):
    accounts.add_project(engine, "vision")
    accounts.add_user(engine, "ana")
    with pytest.raises(Conflict, match="not in project"):
        accounts.issue_token(engine, "ana", "vision")
    accounts.add_member(engine, "ana", "vision")
    made = accounts.issue_token(engine, "ana", "vision", label="laptop")
    token = made["token"]
    assert token.startswith("tyk_") and len(token) > 40
    with read(engine) as conn:
        stored = conn.execute(select(tokens.c.digest)).scalars().all()
    assert stored == [accounts.digest(token)] and token not in stored[0]
    who = accounts.authenticate(engine, token)
    assert who is not None and (who.user, who.admin, who.project) == ("ana", False, "vision")
    assert who.sees(who.project_id) and not who.sees(None) and not who.sees(who.project_id + 1)
    assert accounts.authenticate(engine, token + "x") is None
    assert accounts.authenticate(engine, "not-a-token") is None

    accounts.remove_member(engine, "ana", "vision")
    assert accounts.authenticate(engine, token) is None  # out of the project: refused at once
    accounts.add_member(engine, "ana", "vision")
    assert accounts.authenticate(engine, token) is not None
    accounts.revoke_token(engine, made["id"])
    assert accounts.authenticate(engine, token) is None
    with pytest.raises(NotFound):
        accounts.revoke_token(engine, made["id"])


def test_admins_see_every_project_and_may_hold_a_token_for_none(engine):
    accounts.add_user(engine, "ops", admin=True)
    with pytest.raises(Invalid):
        accounts.add_user(engine, "Bad Name")
    with pytest.raises(Conflict):
        accounts.add_user(engine, "ops")
    with pytest.raises(Conflict):
        accounts.add_user(engine, "admin")
    who = accounts.authenticate(engine, accounts.issue_token(engine, "ops", None)["token"])
    assert who is not None and who.admin and who.project is None and who.sees(None) and who.sees(7)
    accounts.add_user(engine, "bo")
    with pytest.raises(Invalid, match="names a project"):
        accounts.issue_token(engine, "bo", None)


def test_projects_keep_their_share_limits_and_members(engine):
    accounts.add_project(engine, "nlp", share=2.0, limits={"devices": 1})
    accounts.add_user(engine, "cy")
    accounts.add_member(engine, "cy", "nlp")
    accounts.add_member(engine, "cy", "nlp")  # twice: one membership
    assert accounts.get_project(engine, "nlp")["members"] == ["cy"]
    changed = accounts.set_project(engine, "nlp", share=0.5, limits={"devices": 2, "queued_jobs": 10})
    assert (changed["share"], changed["limits"]) == (0.5, {"devices": 2, "queued_jobs": 10})
    users = accounts.list_users(engine)
    assert [(u["name"], u["projects"], u["tokens"]) for u in users] == [("cy", ["nlp"], [])]
    with pytest.raises(NotFound):
        accounts.set_project(engine, "none", share=1.0)


def test_the_audit_record_reads_newest_first(engine):
    who = accounts.Principal("ana", False, 1, "vision")
    for n in range(5):
        audit.record(engine, who, "cancel" if n % 2 else "submit", f"job {n}", "127.0.0.1", {"n": n})
    audit.record(engine, accounts.ADMIN, "token_revoke", "token 3")
    got = audit.entries(engine)
    assert [e["action"] for e in got] == ["token_revoke", "submit", "cancel", "submit", "cancel", "submit"]
    assert got[1]["actor"] == "ana" and got[1]["project"] == "vision" and got[1]["client"] == "127.0.0.1"
    assert [e["target"] for e in audit.entries(engine, action="cancel")] == ["job 3", "job 1"]
    assert [e["target"] for e in audit.entries(engine, limit=2, before=got[1]["id"])] == ["job 3", "job 2"]
    assert [e["actor"] for e in audit.entries(engine, actor="admin")] == ["admin"]
