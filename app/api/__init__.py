"""The HTTP server: app factory, error mapping, body-size limit, and the lease reaper."""
import logging
import threading
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from app import __version__, queue
from app.api.deps import require_token
from app.api.routes import jobs, system
from app.db import create_all, make_engine
from app.settings import Settings, get_settings

log = logging.getLogger("trainyard.api")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.ensure_dirs()
        engine = make_engine(settings.db_url)
        create_all(engine)
        app.state.engine = engine
        stop = threading.Event()
        reaper = threading.Thread(target=_reap, args=(engine, settings.lease_s / 3, stop), daemon=True)
        reaper.start()
        yield
        stop.set()
        reaper.join(timeout=5)
        engine.dispose()

    app = FastAPI(title="trainyard", version=__version__, lifespan=lifespan,
                  description="Run PyTorch training and inference jobs on your GPU machines.")
    app.state.settings = settings
    auth = [Depends(require_token)]
    app.include_router(jobs.router, dependencies=auth)
    app.include_router(system.router, dependencies=auth)
    app.include_router(system.health_router)

    @app.exception_handler(queue.NotFound)
    async def _not_found(request: Request, exc: queue.NotFound):
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(queue.Conflict)
    async def _conflict(request: Request, exc: queue.Conflict):
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(queue.Invalid)
    async def _invalid(request: Request, exc: queue.Invalid):
        # Same shape as FastAPI's own validation errors, so clients parse one format.
        return JSONResponse({"detail": [{"loc": ["body", *exc.loc], "msg": str(exc), "type": "value_error"}]},
                            status_code=422)

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    return app


def _reap(engine, every_s: float, stop: threading.Event) -> None:
    """Requeue jobs whose worker vanished, even when no worker is left to notice."""
    while not stop.wait(every_s):
        try:
            for job_id, state in queue.requeue_expired(engine):
                log.warning("job %s lost its worker (lease expired): now %s", job_id, state)
        except Exception:
            log.exception("lease reaper")


class BodyLimit:
    """Refuse request bodies over max_bytes with 413, whether or not Content-Length is sent."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._reject(send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send):
        body = f'{{"detail":"request body over {self.max_bytes} bytes"}}'.encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
