"""Dependencies shared by the routes: settings, the engine, and the bearer-token check."""
import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from sqlalchemy.engine import Engine

from app.settings import Settings


# These are `async def` although they never await: a plain `def` dependency costs each request a
# round trip through the thread pool.
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_engine(request: Request) -> Engine:
    return request.app.state.engine


async def require_token(request: Request) -> None:
    token = request.app.state.settings.api_token
    if not token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), token.encode()):
        raise HTTPException(401, "missing or wrong bearer token (Authorization: Bearer $TRAINYARD_API_TOKEN)",
                            headers={"WWW-Authenticate": "Bearer"})


SettingsDep = Annotated[Settings, Depends(get_settings)]
EngineDep = Annotated[Engine, Depends(get_engine)]
