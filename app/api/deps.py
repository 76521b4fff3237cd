"""Dependencies shared by the routes: settings, the engine (and its loop reader), and the bearer-token check."""
import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.engine import Engine

from trainyard.app.api.reads import LoopReader
from trainyard.app.settings import Settings


# These are `async def` although they never await: a plain `def` dependency costs each request a
# round trip through the thread pool.
async def app_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_engine(request: Request) -> Engine:
    return request.app.state.engine


async def get_reader(request: Request) -> LoopReader:
    return request.app.state.reader


# Declared as an OpenAPI security scheme: /docs gets an Authorize button, generated clients a token.
bearer = HTTPBearer(auto_error=False, description="TRAINYARD_API_TOKEN, when the server has one")


async def require_token(request: Request,
                        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
    token = request.app.state.settings.api_token
    if not token:
        return
    given = credentials.credentials.strip() if credentials is not None else ""
    if not secrets.compare_digest(given.encode(), token.encode()):
        raise HTTPException(401, "missing or wrong bearer token (Authorization: Bearer $TRAINYARD_API_TOKEN)",
                            headers={"WWW-Authenticate": "Bearer"})


SettingsDep = Annotated[Settings, Depends(app_settings)]
EngineDep = Annotated[Engine, Depends(get_engine)]
ReaderDep = Annotated[LoopReader, Depends(get_reader)]
