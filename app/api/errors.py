"""Errors to responses, in one place: the trainyard error family by its status, request validation
in the same shape, and storage failures as 507 (full) or 503 (database unavailable), never a bare 500."""
import errno
import logging

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DBAPIError, OperationalError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trainyard.app.api.field_names import did_you_mean
from trainyard.app.core.errors import StorageFull, TrainyardError, Unavailable

log = logging.getLogger("trainyard.api")


def install(app: FastAPI) -> None:
    # The decorator form: add_exception_handler types a handler as taking any Exception, though each is
    # called only with the class it is registered for.
    app.exception_handler(TrainyardError)(_trainyard)
    app.exception_handler(RequestValidationError)(_validation)
    app.exception_handler(OSError)(_os_error)
    app.exception_handler(DBAPIError)(_database)
    app.exception_handler(HTTPException)(_http)


def respond(exc: TrainyardError) -> JSONResponse:
    headers = {"Retry-After": str(getattr(exc, "retry_after", 5))} if exc.status == 503 else None
    return JSONResponse({"detail": exc.detail()}, status_code=exc.status, headers=headers)


async def _trainyard(request: Request, exc: TrainyardError) -> JSONResponse:
    return respond(exc)


async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    # Name the field and say what is wrong, without echoing the input back: it may be huge, or a
    # NaN that cannot even be written as JSON.
    tags = _union_tags(request.app)
    detail = []
    for e in exc.errors():
        loc = [p if isinstance(p, (int, str)) else str(p) for p in e["loc"]]
        written, msg = _as_written(loc, exc.body, tags), e["msg"]
        # A misspelt field (train.epcohs) names the one meant, found among the model's own fields.
        if e["type"] == "extra_forbidden" and (near := did_you_mean(request, loc)):
            msg = f"{msg}; did you mean `{near}`?"
        detail.append({"loc": written, "msg": msg, "type": e["type"]})
    return JSONResponse({"detail": detail}, status_code=422)


def _union_tags(app: FastAPI) -> frozenset[str]:
    """The fields that pick a member of a tagged union in any request body (a job's `kind`, a sweep
    parameter's `type`), read once from the app's OpenAPI schema."""
    tags = getattr(app.state, "union_tags", None)
    if tags is None:
        found: set[str] = set()
        todo: list = [app.openapi()]
        while todo:
            node = todo.pop()
            if isinstance(node, dict):
                if isinstance(node.get("discriminator"), dict) and "propertyName" in node["discriminator"]:
                    found.add(node["discriminator"]["propertyName"])
                todo.extend(node.values())
            elif isinstance(node, list):
                todo.extend(node)
        tags = app.state.union_tags = frozenset(found)
    return tags


def _as_written(loc: list, body: object, tags: frozenset[str]) -> list:
    """A body error's path as the client wrote its JSON. Pydantic puts a tagged union's tag into the path
    where it picked the member (a train job's learning rate is body.train.train.lr): that segment, the
    value of the object's tag field (`"kind": "train"`), is dropped, once per object (the second "train"
    there is the field)."""
    if not loc or loc[0] != "body":
        return loc
    out, node, tagged = loc[:1], body, False
    for part in loc[1:]:
        if isinstance(part, str) and isinstance(node, dict) and not tagged and any(node.get(t) == part for t in tags):
            tagged = True
            continue
        out.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and -len(node) <= part < len(node):
            node = node[part]
        else:
            node = None
        tagged = False
    return out


async def _http(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 413:  # the body limit's, raised while a route read the body
        return too_large()
    # FastAPI answers a body its JSON parser gave up on with a bare 400; one nested past the parser's
    # recursion limit (about 1,000 deep) is invalid input like any other: 422 naming the body.
    if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
        return JSONResponse({"detail": [{"loc": ["body"], "msg": "JSON nested too deep to parse (free-form values "
                                         "nest at most 32 deep)", "type": "json_invalid"}]}, status_code=422)
    return await http_exception_handler(request, exc)


async def _os_error(request: Request, exc: OSError) -> JSONResponse:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        log.error("storage full: %s", exc)
        return respond(StorageFull("the server's storage is full (no space left in the data directory); "
                                   "nothing was stored: free space, then retry"))
    raise exc


async def _database(request: Request, exc: DBAPIError) -> JSONResponse:
    text = str(exc.orig)
    if "database or disk is full" in text or "No space left" in text:
        log.error("database storage full: %s", text)
        return respond(StorageFull("the database's storage is full; nothing was stored: free space, then retry"))
    if isinstance(exc, OperationalError) or exc.connection_invalidated:
        log.error("database unavailable: %s", text.splitlines()[0] if text else exc)
        return respond(Unavailable("the database is unavailable; retry shortly"))
    raise exc


TOO_LARGE = ("the request's body is over the server's limit (TRAINYARD_MAX_BODY_BYTES; an upload's: "
             "TRAINYARD_MAX_UPLOAD_BYTES)")


def too_large() -> JSONResponse:
    return JSONResponse({"detail": [{"loc": ["body"], "msg": TOO_LARGE, "type": "too_large"}]}, status_code=413)


class JsonTooLarge:
    """ASGI middleware around the whole app: the body limit (Starlette's, outside every handler and middleware
    of ours) answers a body announced over the limit with a plain-text 413; this sends it as JSON, as every
    other error is."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        replaced = False

        async def send_json(message: Message) -> None:
            nonlocal replaced
            if message["type"] == "http.response.start" and message["status"] == 413 and \
                    Headers(raw=message.get("headers", [])).get("content-type", "").startswith("text/plain"):
                replaced = True
                response = too_large()
                await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
                await send({"type": "http.response.body", "body": response.body})
            elif not replaced:
                await send(message)
        await self.app(scope, receive, send_json)
