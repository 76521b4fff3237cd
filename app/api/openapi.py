"""The OpenAPI document as validators and client generators take it: FastAPI's, tidied once (`tidy`) where it
says less than, or other than, what the server does. Each step works on the document, by path, method or
media type, so it holds for a route wherever its module lives (routes/events.py's streams included).

- Every error the server sends is JSON (ErrorPublic), whatever the success's media type (a log's text, an
  event stream); FastAPI gives a route's errors its success's media type, and its own 422 schema holds only
  a list, where ours may be a sentence.
- The statuses every route can send, from the guard (400 Host, 403 cross-site), the body limit (413) and
  the storage (503 database, 507 full), declared where they apply.
- An event stream's `itemSchema` is OpenAPI 3.2, refused by 3.1 validators: a stream is documented as text.
- An uploaded file's `contentMediaType` alone makes generators send a string: `format: binary` makes it a file;
  a download's or a text's answer without a schema is typed likewise (bytes, a string).
- A request body written out by hand (openapi_extra: the sign-in's, one operation per media type) names its
  model inline: the model goes to the components, so that operations sharing it share one generated class.
- A job's `spec` is the submitted body's schema (the route serialises the stored spec as it is).
- The bearer token is optional: see `OPEN_OR_BEARER`.
"""
from typing import Any

from trainyard.app.api.errors import TOO_LARGE

ERROR = {"$ref": "#/components/schemas/ErrorPublic"}
SAFE = frozenset({"get", "head", "options"})
# Statuses any route may send beside its own, and the routes that send each.
SHARED = {
    400: ("this server does not answer for that Host (TRAINYARD_ALLOWED_HOSTS)",
          lambda path, method: path != "/healthz"),
    403: ("a state-changing request from another web origin (TRAINYARD_ALLOWED_ORIGINS)",
          lambda path, method: method not in SAFE),
    413: (TOO_LARGE, lambda path, method: method not in SAFE),
    503: ("the database or the object store is unavailable: retry after Retry-After seconds",
          lambda path, method: True),
    507: ("the server's storage is full; nothing was stored", lambda path, method: method not in SAFE),
}
# One document serves every installation (it holds no data, and is served without a token): a server with
# TRAINYARD_API_TOKEN requires the token on every route but /healthz (401 otherwise, declared), and one without
# it answers only on loopback, without a token. `{}` says a request without one may be answered, so that
# generated clients make the token optional rather than refuse to call without it.
OPEN_OR_BEARER: list[dict[str, list[str]]] = [{}, {"HTTPBearer": []}]
STREAM_TEXT = {"schema": {"type": "string", "description": "Server-Sent Events (text/event-stream): `event:`, "
                                                           "`id:` and `data:` (JSON) lines"}}


def tidy(doc: dict[str, Any]) -> dict[str, Any]:
    """The document, changed in place (and returned): see the module's docstring."""
    schemas = doc.get("components", {}).get("schemas", {})
    for path, methods in doc.get("paths", {}).items():
        for method, op in methods.items():
            _operation(path, method, op)
            for media in op.get("requestBody", {}).get("content", {}).values():
                _shared_model(media, schemas)
    for schema in schemas.values():
        for prop in schema.get("properties", {}).values():
            if prop.get("type") == "string" and prop.get("contentMediaType") == "application/octet-stream":
                prop["format"] = "binary"
    submitted = doc["paths"]["/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    spec = {k: v for k, v in submitted.items() if k != "title"}
    schemas["JobPublic"]["properties"]["spec"] = {**spec, "description": "the job as submitted"}
    schemas["JobListItem"]["properties"]["spec"] = {"anyOf": [spec, {"type": "null"}],
                                                    "description": "present with include=spec"}
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, replaced by ErrorPublic
        schemas.pop(unused, None)
    return doc


def _shared_model(media: dict[str, Any], schemas: dict[str, Any]) -> None:
    schema = media.get("schema", {})
    if schema.get("type") == "object" and "properties" in schema and schema.get("title"):
        schemas.setdefault(schema["title"], schema)
        media["schema"] = {"$ref": f"#/components/schemas/{schema['title']}"}


def _operation(path: str, method: str, op: dict[str, Any]) -> None:
    if op.get("security"):
        op["security"] = OPEN_OR_BEARER
    responses = op.setdefault("responses", {})
    for status, (description, applies) in SHARED.items():
        if applies(path, method) and str(status) not in responses:
            responses[str(status)] = {"description": description}
    for status, response in responses.items():
        content = response.get("content", {})
        if int(status) >= 400:
            response["content"] = {"application/json": {"schema": ERROR}}
            if status == "422" and response.get("description") == "Validation Error":
                response["description"] = "a field is wrong: `detail` names it"
            continue
        for media_type, media in content.items():
            if "itemSchema" in media or media_type == "text/event-stream":
                content[media_type] = STREAM_TEXT
            elif "schema" not in media:  # a file (bytes), or text (Prometheus's)
                binary = media_type == "application/octet-stream"
                media["schema"] = {"type": "string", **({"format": "binary"} if binary else {})}
