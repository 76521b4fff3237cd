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

And one kind of input no route means: a NUL character. PostgreSQL's text cannot hold one (the query fails: a
500 where a name, a label, a filter or a worker's id reached SQL), and no name, label or value of this API
needs one, so a request carrying one anywhere it could reach a route (its path, query string, headers or JSON
body) is refused with a 422 naming where, before any route sees it: one rule for every route, present and future.
"""
import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
    """ASGI middleware: 400 for a Host not served, 403 for a cross-site state-changing request, 422 for a NUL."""

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
        where = nul_outside_body(scope)
        if where is None and scope.get("method", "GET") not in SAFE_METHODS and json_body(headers):
            # The whole body is read here (FastAPI reads a JSON body whole anyway, within the body limit, which
            # sits outside this middleware), then handed on as it came.
            messages, body = await _read_body(receive)
            where, receive = nul_in_json(body), _replay(messages, receive)
        if where is not None:
            return await _refuse(send, 422, [{"loc": where, "msg": NUL_MESSAGE, "type": "nul_character"}])
        await self.app(scope, receive, send)


NUL_MESSAGE = "a NUL character (\\u0000, %00) is refused everywhere in a request"
# \u0000 in JSON text, unless its backslash is itself escaped (an even run of backslashes before it).
NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def nul_outside_body(scope: Scope) -> list[str | int] | None:
    """Where a NUL is in the request's path (as decoded), query string (a name or a value, %00 decoded) or
    headers, as a validation error's loc; None if nowhere."""
    if "\x00" in scope["path"]:
        return ["path"]
    query = scope.get("query_string", b"")
    if b"\x00" in query or b"%00" in query:
        for name, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True, encoding="latin-1"):
            if "\x00" in name or "\x00" in value:
                return ["query", name.replace("\x00", "")]
        return ["query"]
    for name, value in scope["headers"]:
        if b"\x00" in value:
            return ["header", name.decode("latin-1")]
    return None


def json_body(headers: Headers) -> bool:
    """Whether FastAPI would read the body as JSON: no content type, or application/json or +json."""
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    return kind in ("", "application/json") or (kind.startswith("application/") and kind.endswith("+json"))


def nul_in_json(body: bytes) -> list[str | int] | None:
    """Where a NUL is in a JSON body (a key's or a string's path), as a validation error's loc; None if nowhere."""
    if b"\x00" not in body and not NUL_ESCAPE.search(body):
        return None
    try:
        found = next(_nul_paths(json.loads(body)), None)
    except ValueError:  # not JSON after all: the route says so, but not with a NUL in it
        found = None
    return ["body", *(found or [])]


def _nul_paths(value: Any, path: tuple = ()) -> Iterator[list[str | int]]:
    if isinstance(value, str) and "\x00" in value:
        yield list(path)
    elif isinstance(value, dict):
        for key, item in value.items():
            if "\x00" in key:
                yield [*path, key.replace("\x00", "")]
            yield from _nul_paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _nul_paths(item, (*path, i))


async def _read_body(receive: Receive) -> tuple[list[Message], bytes]:
    messages, chunks = [], []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return messages, b"".join(chunks)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """The messages read, in order, then the client's own (a disconnect, for a route that waits for one)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()
    return replayed


async def _refuse(send: Send, status: int, detail: str | list) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
