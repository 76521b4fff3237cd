"""app/api: the HTTP API, its OpenAPI document, streams, the dashboard, the guards and limits, uploads."""
