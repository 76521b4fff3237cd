"""Dependencies shared by the routes: settings, the engine (and its loop reader), and who is asking (the bearer
token's principal)."""
import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.engine import Engine

from trainyard.app import accounts
from trainyard.app.accounts import Principal, signins
from trainyard.app.api.reads import LoopReader
from trainyard.app.core import operator_token
from trainyard.app.core.settings import Settings


# These are `async def` although they never await: a plain `def` dependency costs each request a
# round trip through the thread pool.
async def app_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_engine(request: Request) -> Engine:
    return request.app.state.engine


async def get_reader(request: Request) -> LoopReader:
    return request.app.state.reader


# The dashboard's session: its id (app/accounts/signins.py; never the token it signed in with), in an HttpOnly
# cookie its
# script cannot read (app/api/routes/dashboard.py sets it). Read only when no Authorization header is sent.
COOKIE = "trainyard_token"
# Declared as an OpenAPI security scheme: /docs gets an Authorize button, generated clients a token.
bearer = HTTPBearer(auto_error=False, description="a user's token (tyk_...), or TRAINYARD_API_TOKEN, the admin's")


async def known_principal(request: Request, token: str) -> Principal | None:
    """Whom a token names on this server: TRAINYARD_API_TOKEN is the admin, a user's live token its user in its
    project (one fresh read through the loop reader); anything else None."""
    configured = request.app.state.settings.api_token
    if configured and secrets.compare_digest(token.encode(), configured.encode()):
        return accounts.ADMIN
    if token.startswith(accounts.PREFIX):
        return await request.app.state.reader.run(lambda engine: accounts.authenticate(engine, token))
    return None


async def cookie_principal(request: Request) -> Principal | None:
    """Whom the request's sign-in cookie acts as: its session's token's principal while both hold (one fresh read
    through the loop reader); None without a cookie, or for one no longer good."""
    session = request.cookies.get(COOKIE, "")
    if not session:
        return None
    configured = request.app.state.settings.api_token
    root = accounts.digest(configured) if configured else None
    return await request.app.state.reader.run(lambda engine: signins.principal(engine, session, root))


async def require_token(request: Request,
                        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
    """Who the request acts as (app/accounts/__init__.py): the token's principal. A token sent and not known is a 401,
    whatever the server's mode. With no TRAINYARD_API_TOKEN, a request sending none acts as the admin only when
    it comes from this machine (at_the_machine); anyone else gets 401. FastAPI computes it once per request,
    so a route that asks for WhoDep gets the router's answer."""
    if credentials is not None:
        who = await known_principal(request, credentials.credentials.strip())
    else:
        # A stale or foreign sign-in cookie is no claim to anything: it counts as no token.
        who = await cookie_principal(request)
        if who is None and not request.app.state.settings.api_token and at_the_machine(request):
            return accounts.ADMIN
    if who is not None:
        return who
    raise HTTPException(401, "missing, wrong or revoked bearer token (Authorization: Bearer <your token>, or "
                             "$TRAINYARD_API_TOKEN)", headers={"WWW-Authenticate": "Bearer"})


# Headers a proxy writes for the client it relays. A request carrying one came through a proxy: its loopback
# peer is the proxy, not a person at this machine. (uvicorn also puts X-Forwarded-For's client in the peer's
# place when the peer is 127.0.0.1, its default forwarded_allow_ips: then the peer is not loopback either.)
FORWARDED = ("forwarded", "x-forwarded-for", "x-real-ip")


def at_the_machine(request: Request) -> bool:
    """Whether the request's own connection (its peer address, which the client cannot write) comes from this
    machine's loopback, not relayed by a proxy. Host and the other headers the client writes decide nothing."""
    peer = request.client.host if request.client else ""
    return operator_token.loopback(peer) and not any(h in request.headers for h in FORWARDED)


async def require_admin(who: Annotated[Principal, Depends(require_token)]) -> Principal:
    """Admins only (accounts, the audit record, draining workers): anyone else gets 403."""
    if not who.admin:
        raise HTTPException(403, f"user {who.user!r} is not an admin")
    return who


def client_address(request: Request) -> str | None:
    return request.client.host if request.client else None


SettingsDep = Annotated[Settings, Depends(app_settings)]
EngineDep = Annotated[Engine, Depends(get_engine)]
ReaderDep = Annotated[LoopReader, Depends(get_reader)]
WhoDep = Annotated[Principal, Depends(require_token)]
AdminDep = Annotated[Principal, Depends(require_admin)]
