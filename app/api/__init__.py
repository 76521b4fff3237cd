"""The HTTP server: app factory, request guard, error mapping, the lease reaper and the sweeps' driver."""
import fcntl
import logging
import os
import threading
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

from fastapi import Depends, FastAPI

from trainyard.app import __version__, metrics, queue, schema, search
from trainyard.app.api import errors
from trainyard.app.api.deps import require_token
from trainyard.app.api.guard import RequestGuard
from trainyard.app.api.reads import LoopReader
from trainyard.app.api.routes import dashboard, datasets, jobs, sweeps, system
from trainyard.app.api.schemas import UNAUTHORIZED
from trainyard.app.api.streams import StreamSlots, SweepHub
from trainyard.app.db import make_engine
from trainyard.app.settings import Settings, get_settings

log = logging.getLogger("trainyard.api")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.ensure_dirs()
        engine = make_engine(settings.db_url)
        schema.prepare(engine)
        app.state.engine = engine
        app.state.reader = LoopReader(engine, settings.db_url)
        app.state.streams = StreamSlots(settings.max_event_streams, settings.max_event_streams_per_target)
        app.state.sweep_hub = SweepHub(partial(sweeps.watched, engine), sweeps.EVENTS_POLL_S)
        app.state.metrics_registry = metrics.registry(engine, settings.lease_s, settings.node)
        stop = threading.Event()
        reaper = threading.Thread(target=_reap, args=(engine, settings.lease_s / 3, stop,
                                                      settings.layout.housekeeping_lock), daemon=True)
        reaper.start()
        # Sweeps advance in one server process per host (the holder of the sweeps lock), like the reaper.
        app.state.searcher = search.Searcher(engine, settings)
        searching = threading.Thread(target=app.state.searcher.run, args=(stop, settings.layout.sweeps_lock),
                                     daemon=True, name="sweeps")
        searching.start()
        yield
        stop.set()
        app.state.searcher.poke()
        reaper.join(timeout=5)
        searching.join(timeout=5)
        app.state.reader.dispose()
        engine.dispose()

    # max_body_size: bodies over the limit get 413, with or without a Content-Length.
    app = FastAPI(title="trainyard", version=__version__, lifespan=lifespan, max_body_size=settings.max_body_bytes,
                  description="Run PyTorch training and inference jobs on your GPU machines.")
    app.state.settings = settings
    app.add_middleware(RequestGuard, allowed_hosts=settings.allowed_host_list,
                       allowed_origins=settings.allowed_origin_list)
    auth = [Depends(require_token)]
    app.include_router(jobs.router, dependencies=auth, responses=UNAUTHORIZED)
    app.include_router(sweeps.router, dependencies=auth, responses=UNAUTHORIZED)
    app.include_router(datasets.make_router(settings), dependencies=auth, responses=UNAUTHORIZED)
    app.include_router(system.router, dependencies=auth, responses=UNAUTHORIZED)
    app.include_router(system.health_router)
    app.include_router(dashboard.router)  # the page holds no data: served without auth, its API calls carry the token

    errors.install(app)
    return app


def _reap(engine, every_s: float, stop: threading.Event, lock_path: Path) -> None:
    """Requeue jobs whose worker vanished, even when no worker is left to notice.

    Workers run the same sweep in their housekeeping, on purpose: with several hosts, any live
    process that can reach the database recovers a lost job, whether or not this server is up.
    requeue_expired is fenced per job, so several sweeps at once requeue each job once; the cost
    is one indexed read per sweep. Of a host's server processes (`serve --workers N`) only the one
    holding the housekeeping lock sweeps; if it dies, the lock is free and another takes over."""
    held = False
    with open(lock_path, "a") as lock:
        while not stop.wait(every_s):
            if not held:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # another server process of this host sweeps
                held = True
                log.info("lease reaper: server process %s sweeps for this host", os.getpid())
            try:
                for job_id, state in queue.requeue_expired(engine):
                    log.warning("job %s lost its worker (lease expired): now %s", job_id, state)
            except Exception:
                log.exception("lease reaper")
