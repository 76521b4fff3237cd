"""The web dashboard: one static page at `/`, its script and stylesheet (no build step), and its session.

The page and its assets are served without auth (a browser cannot send a bearer token when it navigates); they
hold no data. The page signs in by posting a token to /session (JSON; a form's post goes to /session/form, one
media type per operation, as client generators need), which opens a session of its own
(app/accounts/signins.py)
and sets its id, never the token, in an HttpOnly cookie (deps.COOKIE) that no script can read; the browser sends
it with every API call of the page, and deps.require_token reads it when no Authorization header is sent. The
session ends with its token (revoked, expired, its user deleted), at sign-out, or after the cookie's max-age.
Signing in changes state, so the request guard (app/api/guard.py) refuses it from other web origins: no other
site can sign a browser in, as anyone.
"""
import json
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from trainyard.app import accounts
from trainyard.app.accounts import signins
from trainyard.app.api.deps import COOKIE, known_principal
from trainyard.app.api.schemas import ErrorPublic

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
# An explicit list: nothing a client sends becomes a path.
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
# The page talks to its own origin only: no CDN, no fonts, no fetches anywhere else.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "Content-Security-Policy": CSP,
           "Referrer-Policy": "no-referrer"}
# How long a browser keeps the cookie, and the longest a session lives (less when its token expires sooner). The
# token itself is checked on every request, so a revoked one is refused at once whatever the cookie's age.
SESSION_MAX_AGE_S = 30 * 24 * 3600
# Browsers drop a cookie over 4096 bytes; no token of ours comes near.
TOKEN_MAX = 2000
REFUSED = "this token is not one of this server's (wrong, revoked, or its user is no longer in its project)"

router = APIRouter()


class SessionIn(BaseModel):
    token: str = Field(min_length=1, max_length=TOKEN_MAX,
                       description="a user's token (tyk_...), or TRAINYARD_API_TOKEN, the admin's")


def session_body(media: str) -> dict[str, Any]:
    return {"required": True, "content": {media: {"schema": SessionIn.model_json_schema()}}}


SIGN_IN_RESPONSES: dict[int | str, dict[str, Any]] = {
    204: {"description": "signed in: the cookie is set"}, 401: {"model": ErrorPublic, "description": REFUSED},
    422: {"model": ErrorPublic, "description": "no token in the body"}}


@router.get("/", include_in_schema=False)
def index() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/static/{name}", include_in_schema=False)
def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise HTTPException(404, "not found")
    return FileResponse(STATIC_DIR / name, media_type=ASSETS[name], headers=HEADERS)


async def given_token(request: Request) -> str:
    """The token of a sign-in, from a JSON body or a form's (`token`); 422 when neither holds one."""
    try:
        if request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
            async with request.form(max_files=0, max_fields=4) as form:
                raw: Any = {k: v for k, v in form.items() if isinstance(v, str)}
        else:
            raw = json.loads(await request.body() or b"null")
        return SessionIn.model_validate(raw).token.strip()
    except (ValueError, ValidationError) as e:  # JSONDecodeError is a ValueError
        raise HTTPException(422, "send {\"token\": \"<your token>\"} as JSON, or a form with a `token` field") from e


@router.post("/session", tags=["session"], operation_id="sign_in", status_code=204, response_class=Response,
             openapi_extra={"requestBody": session_body("application/json")}, responses=SIGN_IN_RESPONSES)
async def sign_in(request: Request, token: Annotated[str, Depends(given_token)]) -> Response:
    """Sign a browser in: a session of the token's, whose id (not the token) is kept in an HttpOnly cookie
    (SameSite=Strict; Secure over https) that the browser sends with each request, in place of an Authorization
    header. The session ends when its token is revoked or expires, at sign-out, or after 30 days. For the
    dashboard; other clients send the header. (A form's body is read here too, as it always was: POST
    /session/form is the operation that documents it.)"""
    return await _open(request, token)


@router.post("/session/form", tags=["session"], operation_id="sign_in_form", status_code=204,
             response_class=Response, openapi_extra={"requestBody": session_body("application/x-www-form-urlencoded")},
             responses=SIGN_IN_RESPONSES)
async def sign_in_form(request: Request, token: Annotated[str, Depends(given_token)]) -> Response:
    """Sign a browser in with a form's `token` field: as POST /session (which takes JSON), its own operation so
    that each has one media type."""
    return await _open(request, token)


async def _open(request: Request, token: str) -> Response:
    """The session of a sign-in, its cookie set; 401 for a token not this server's."""
    if await known_principal(request, token) is None:
        raise HTTPException(401, REFUSED, headers={"WWW-Authenticate": "Bearer"})
    session = await run_in_threadpool(signins.open_session, request.app.state.engine, accounts.digest(token),
                                      SESSION_MAX_AGE_S)
    response = Response(status_code=204, headers={"Cache-Control": "no-store"})
    response.set_cookie(COOKIE, session, max_age=SESSION_MAX_AGE_S, path="/", secure=request.url.scheme == "https",
                        httponly=True, samesite="strict")
    return response


@router.delete("/session", tags=["session"], operation_id="sign_out", status_code=204, response_class=Response,
               responses={204: {"description": "signed out: the cookie is cleared"}})
async def sign_out(request: Request) -> Response:
    """Sign a browser out: its session ends and its cookie is cleared (the token itself stays valid until revoked
    or expired)."""
    if session := request.cookies.get(COOKIE, ""):
        await run_in_threadpool(signins.end_session, request.app.state.engine, session)
    response = Response(status_code=204, headers={"Cache-Control": "no-store"})
    response.delete_cookie(COOKIE, path="/", secure=request.url.scheme == "https", httponly=True, samesite="strict")
    return response
