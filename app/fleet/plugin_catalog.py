"""The plugins the fleet offers: every plugin installed on this server or on a live worker, and where (GET /catalog,
and admission's check that a job names plugins some worker has). Discovered from entry points and the workers'
heartbeats, never imported here. Torch-free.
"""
from sqlalchemy.engine import Engine

from trainyard.app.core import plugins
from trainyard.app.core.settings import Settings
from trainyard.app.fleet import workers as registry


def plugin_catalog(engine: Engine, settings: Settings) -> list[dict]:
    """Every plugin installed on this server or on a live worker: kind, name, distribution, version and
    `installed_on` ("this server", worker ids)."""
    found: dict[tuple[str, str], dict] = {}

    def add(detail: dict, where: str) -> None:
        entry = found.setdefault((detail["kind"], detail["name"]), {**detail, "installed_on": []})
        entry["installed_on"].append(where)

    for p in plugins.describe(plugins.offered(settings.plugins)):
        add(p, "this server")
    workers, now = registry.list_workers(engine)
    for w in workers:
        if registry.worker_state(w, now, settings.lease_s) in registry.LIVE:
            for p in (w.get("stats") or {}).get("plugin_details") or []:
                add(p, w["id"])
    return [{k: v for k, v in e.items() if k != "value"} for _, e in sorted(found.items())]


def known_plugins(engine: Engine, settings: Settings) -> dict[str, dict[str, list[str]]]:
    """kind -> name -> where it is installed, among this server and the live workers."""
    known: dict[str, dict[str, list[str]]] = {kind: {} for kind in plugins.GROUPS}
    for p in plugin_catalog(engine, settings):
        known.setdefault(p["kind"], {})[p["name"]] = p["installed_on"]
    return known
