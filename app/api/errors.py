"""Errors to responses, in one place: the trainyard error family by its status, request validation
in the same shape, and storage failures as 507 (full) or 503 (database unavailable), never a bare 500."""
import errno
import logging

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DBAPIError, OperationalError
from starlette.exceptions import HTTPException

from trainyard.app.errors import StorageFull, TrainyardError, Unavailable

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
    detail = [{"loc": [p if isinstance(p, (int, str)) else str(p) for p in e["loc"]], "msg": e["msg"],
               "type": e["type"]} for e in exc.errors()]
    return JSONResponse({"detail": detail}, status_code=422)


async def _http(request: Request, exc: HTTPException) -> Response:
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
