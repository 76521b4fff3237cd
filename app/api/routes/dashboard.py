"""The web dashboard: one static page at `/` and its script and stylesheet, no build step.

The page and its assets are served without auth (a browser cannot send a bearer token when it
navigates); they hold no data. Every API call the page makes carries the token it asks for.
"""
from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
# An explicit list: nothing a client sends becomes a path.
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
# The page talks to its own origin only: no CDN, no fonts, no fetches anywhere else.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "Content-Security-Policy": CSP,
           "Referrer-Policy": "no-referrer"}

router = APIRouter(include_in_schema=False)


@router.get("/", include_in_schema=False)
def index() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/static/{name}", include_in_schema=False)
def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise HTTPException(404, "not found")
    return FileResponse(STATIC_DIR / name, media_type=ASSETS[name], headers=HEADERS)
