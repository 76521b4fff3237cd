"""The HTTP server's app factory: `create_app` wires the routes, the request guard and the error mapping,
and its lifespan opens the database and starts the background duties (app/duties/loops.py)."""
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.routing import APIRoute

from trainyard.app import __version__
from trainyard.app.api import errors, openapi
from trainyard.app.api.deps import require_token
from trainyard.app.api.guard import RequestGuard
from trainyard.app.api.reads import LoopReader
from trainyard.app.api.routes import admin, dashboard, datasets, events, job_files, jobs, storage, sweeps, system
from trainyard.app.api.schemas import UNAUTHORIZED
from trainyard.app.api.streams import StreamSlots, SweepHub
from trainyard.app.core.settings import Settings, get_settings
from trainyard.app.db import make_engine, migrate
from trainyard.app.duties import loops
from trainyard.app.observe import prometheus


class Api(FastAPI):
    """The app: FastAPI's, with its OpenAPI document tidied (app/api/openapi.py) and its body limit's 413 sent
    as JSON (errors.JsonTooLarge, around the limit, which sits outside every middleware of ours)."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            openapi.tidy(super().openapi())
        return super().openapi()

    def build_middleware_stack(self):
        return errors.JsonTooLarge(super().build_middleware_stack())


def operation_id(route: APIRoute) -> str:
    """A route's operation id: its own (every route names one: generated clients' methods are named by it),
    else its function's name; also names its body's schema (Body_upload_dataset)."""
    return route.operation_id or route.name


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.ensure_dirs()
        engine = make_engine(settings.db_url)
        migrate.prepare(engine)
        app.state.engine = engine
        app.state.reader = LoopReader(engine, settings.db_url)
        app.state.streams = StreamSlots(settings.max_event_streams, settings.max_event_streams_per_target,
                                        settings.per_project("max_event_streams"))
        app.state.sweep_hub = SweepHub(partial(sweeps.watched, engine), sweeps.EVENTS_POLL_S)
        app.state.metrics_registry = prometheus.registry(engine, settings.lease_s, settings.node)
        # The lease reaper and the sweeps' driver (app/duties/loops.py); routes poke the searcher.
        duties = loops.Duties(engine, settings)
        app.state.searcher = duties.searcher
        duties.start()
        yield
        duties.stop()
        app.state.reader.dispose()
        engine.dispose()

    # max_body_size: bodies over the limit get 413, with or without a Content-Length.
    app = Api(title="trainyard", version=__version__, lifespan=lifespan, max_body_size=settings.max_body_bytes,
              description="Run PyTorch training and inference jobs on your GPU machines.",
              generate_unique_id_function=operation_id)
    app.state.settings = settings
    app.add_middleware(RequestGuard, allowed_hosts=settings.allowed_host_list,
                       allowed_origins=settings.allowed_origin_list)
    auth = [Depends(require_token)]
    app.include_router(jobs.router, dependencies=auth, responses=UNAUTHORIZED)
    app.include_router(job_files.router, dependencies=auth, responses=UNAUTHORIZED)
    app.include_router(sweeps.router, dependencies=auth, responses=UNAUTHORIZED)
    app.include_router(events.router, dependencies=auth, responses=UNAUTHORIZED)
    app.include_router(datasets.make_router(settings), dependencies=auth, responses=UNAUTHORIZED)
    app.include_router(system.router, dependencies=auth, responses=UNAUTHORIZED)
    app.include_router(storage.router, dependencies=auth, responses=UNAUTHORIZED)
    app.include_router(admin.router, dependencies=auth, responses=UNAUTHORIZED)
    app.include_router(admin.me_router, dependencies=auth, responses=UNAUTHORIZED)
    app.include_router(system.health_router)
    app.include_router(dashboard.router)  # the page holds no data: served without auth, its API calls carry the token

    errors.install(app)
    return app
