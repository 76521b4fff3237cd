"""Names both sides of the HTTP API use, defined once: the server's routes (app/api/) and the client
(app/client/, which may import only core: pyproject's client-apart contract)."""

# GET /jobs/{id}/metrics (and its events): present when more records follow, it holds the `since` of the next page.
NEXT_SINCE = "X-Next-Since"
