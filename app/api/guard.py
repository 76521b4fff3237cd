"""Which requests the server answers at all: the hosts it serves, and writes only from its own pages.

Two attacks a service on localhost meets through its user's browser, token or no token:
- Cross-site requests: any web page the user visits can POST a form or a no-cors fetch to
  http://127.0.0.1:8000 (a "simple" request needs no CORS preflight). Browsers say where such a
  request comes from (`Origin`, `Sec-Fetch-Site`), so a state-changing request is refused unless it
  comes from the server's own origin, from one listed in TRAINYARD_ALLOWED_ORIGINS, or from no
  browser at all (curl, httpx and the CLI send neither header).
- DNS rebinding: a hostile name that resolves to 127.0.0.1 makes the attacker's page same-origin
  with the server; its requests still carry the hostile name in `Host`, so only the hosts in
  TRAINYARD_ALLOWED_HOSTS are answered.
"""
import json
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Sec-Fetch-Site values of requests a browser makes on the page's own behalf or the user's
# (typed URL, bookmark): neither is another site acting.
OWN_SITE = frozenset({"same-origin", "none"})


def host_name(host: str) -> str:
    """The name in a Host header, without its port (IPv6 literals keep their brackets)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host: str, allowed: list[str]) -> bool:
    name = host_name(host)
    for pattern in allowed:
        pattern = pattern.lower()
        if pattern == "*" or name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    return False


def cross_site(headers: Headers, allowed_origins: list[str]) -> str | None:
    """Why a state-changing request must be refused as another site's, or None when it may proceed."""
    origin = headers.get("origin")
    if origin is not None:
        if origin.rstrip("/") in allowed_origins:
            return None
        if origin == "null" or urlsplit(origin).netloc.lower() != headers.get("host", "").lower():
            return f"a request from another web origin ({origin[:100]}) may not change anything here"
        return None
    site = headers.get("sec-fetch-site")
    if site is not None and site not in OWN_SITE:
        return f"a {site} request from a web page may not change anything here"
    return None


class RequestGuard:
    """ASGI middleware: 400 for a Host not served, 403 for a cross-site state-changing request."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str], allowed_origins: list[str]):
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.allowed_origins = allowed_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        # /healthz holds no data, and probes (a container's, a load balancer's) often name the
        # server by an address or a service name that users never browse to.
        if scope["path"] != "/healthz" and not host_allowed(headers.get("host", ""), self.allowed_hosts):
            return await _refuse(send, 400, f"this server does not answer for host "
                                            f"{headers.get('host', '')[:100]!r} (TRAINYARD_ALLOWED_HOSTS)")
        if scope.get("method", "GET") not in SAFE_METHODS:
            why = cross_site(headers, self.allowed_origins)
            if why:
                return await _refuse(send, 403, f"{why} (TRAINYARD_ALLOWED_ORIGINS lists the web origins that may)")
        await self.app(scope, receive, send)


async def _refuse(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
