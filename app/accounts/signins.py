"""The dashboard's sign-ins: a session of its own per sign-in, so that the browser's cookie never holds a token.

Signing in with a token (POST /session) makes a session: "tys_" and 43 URL-safe characters (256 random bits),
set as the cookie and stored as its SHA-256 digest only, with the digest of the token it signed in with. Each
request the cookie brings checks the session (not ended, not past its expiry) and then that token, afresh, as
a bearer token is checked (app/accounts/__init__.py): revoking the token, its expiry, its user's deletion, their leaving
its project, or (for TRAINYARD_API_TOKEN) a change of that variable ends the session at once. A session lives
at most as long as its token and at most the cookie's max-age; signing out deletes it. Torch-free.
"""
import secrets
import time

from sqlalchemy import delete, insert, select
from sqlalchemy.engine import Engine

from trainyard.app import accounts
from trainyard.app.accounts import Principal
from trainyard.app.db import db_now, read, sessions, tokens, write

PREFIX = "tys_"


def open_session(engine: Engine, token_digest: str, max_age_s: float) -> str:
    """A new session for the token of that digest (checked by the caller): its id, for the cookie only."""
    session = PREFIX + secrets.token_urlsafe(32)
    with write(engine) as conn:
        now = conn.execute(select(db_now())).scalar_one()
        token_expires = conn.execute(select(tokens.c.expires_at).where(tokens.c.digest == token_digest)).scalar()
        expires_at = now + max_age_s if token_expires is None else min(now + max_age_s, token_expires)
        # Sessions past their time are dropped here, where they are made: the table holds no more than the live
        # ones and those of the last max-age.
        conn.execute(delete(sessions).where(sessions.c.expires_at <= now))
        conn.execute(insert(sessions).values(digest=accounts.digest(session), token_digest=token_digest,
                                             created_at=time.time(), expires_at=expires_at))
    return session


def principal(engine: Engine, session: str, root_digest: str | None) -> Principal | None:
    """Whom a session cookie acts as: its token's principal while both hold; None otherwise. root_digest: the
    digest of TRAINYARD_API_TOKEN (None without one), whose sessions act as the admin."""
    if not session.startswith(PREFIX):
        return None
    with read(engine) as conn:
        token_digest = conn.execute(select(sessions.c.token_digest).where(
            sessions.c.digest == accounts.digest(session), sessions.c.expires_at > db_now())).scalar()
        if token_digest is None:
            return None
        if root_digest is not None and secrets.compare_digest(token_digest, root_digest):
            return accounts.ADMIN
        return accounts.principal_of(conn, token_digest)


def end_session(engine: Engine, session: str) -> None:
    """Sign-out: the session is deleted (a copy of the cookie signs no one in from then on)."""
    with write(engine) as conn:
        conn.execute(delete(sessions).where(sessions.c.digest == accounts.digest(session)))
