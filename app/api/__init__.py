"""The HTTP server: app factory, error mapping and the lease reaper."""
import logging
import threading
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from app import __version__, metrics, queue
from app.api.deps import require_token
from app.api.routes import dashboard, datasets, jobs, system
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
        app.state.metrics_registry = metrics.registry(engine, settings.lease_s)
        stop = threading.Event()
        reaper = threading.Thread(target=_reap, args=(engine, settings.lease_s / 3, stop), daemon=True)
        reaper.start()
        yield
        stop.set()
        reaper.join(timeout=5)
        engine.dispose()

    # max_body_size: bodies over the limit get 413, with or without a Content-Length.
    app = FastAPI(title="trainyard", version=__version__, lifespan=lifespan, max_body_size=settings.max_body_bytes,
                  description="Run PyTorch training and inference jobs on your GPU machines.")
    app.state.settings = settings
    auth = [Depends(require_token)]
    app.include_router(jobs.router, dependencies=auth)
    app.include_router(datasets.router, dependencies=auth)
    app.include_router(system.router, dependencies=auth)
    app.include_router(system.health_router)
    app.include_router(dashboard.router)  # the page holds no data: served without auth, its API calls carry the token

    @app.exception_handler(queue.NotFound)
    async def _not_found(request: Request, exc: queue.NotFound):
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(queue.Conflict)
    async def _conflict(request: Request, exc: queue.Conflict):
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        # Name the field and say what is wrong, without echoing the input back: it may be huge,
        # or a NaN that cannot even be written as JSON.
        detail = [{"loc": [p if isinstance(p, (int, str)) else str(p) for p in e["loc"]], "msg": e["msg"],
                   "type": e["type"]} for e in exc.errors()]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(queue.Invalid)
    async def _invalid(request: Request, exc: queue.Invalid):
        # Same shape as FastAPI's own validation errors, so clients parse one format.
        return JSONResponse({"detail": [{"loc": ["body", *exc.loc], "msg": str(exc), "type": "value_error"}]},
                            status_code=422)

    return app


def _reap(engine, every_s: float, stop: threading.Event) -> None:
    """Requeue jobs whose worker vanished, even when no worker is left to notice."""
    while not stop.wait(every_s):
        try:
            for job_id, state in queue.requeue_expired(engine):
                log.warning("job %s lost its worker (lease expired): now %s", job_id, state)
        except Exception:
            log.exception("lease reaper")
