"""Routes about what the store holds: GET /storage (the collector's last measure and the retention rules: an admin's
of the whole store, a member's of their own project) and POST /storage/collect (a pass of the collector now,
app/lifecycle/collector.py: admins only, audited)."""
from datetime import datetime

from fastapi import APIRouter, Request

from trainyard.app.accounts import audit
from trainyard.app.api.deps import AdminDep, EngineDep, SettingsDep, WhoDep, client_address
from trainyard.app.api.schemas import ts
from trainyard.app.api.schemas_admin import FORBIDDEN
from trainyard.app.api.schemas_service import (
    CollectionPublic,
    KindUsage,
    ProjectUsage,
    StoragePublic,
    StorageRules,
)
from trainyard.app.core.settings import Settings
from trainyard.app.lifecycle import collector, project_storage

router = APIRouter(prefix="/storage", tags=["storage"])


@router.get("", response_model=StoragePublic, operation_id="get_storage")
def get_storage(engine: EngineDep, settings: SettingsDep, who: WhoDep) -> StoragePublic:
    """What the store holds by kind, as the collector's last pass measured it (it runs every
    TRAINYARD_COLLECT_S, or on POST /storage/collect), and the retention rules it applies. A member is shown
    their own project's bytes and objects instead, never the store's place nor what other projects hold."""
    usage = collector.usage(engine)
    if who.admin:
        return StoragePublic(store=settings.store.describe(), kinds=kinds(usage), measured_at=measured_at(usage),
                             rules=rules(settings))
    used, objects = (0, 0) if who.project_id is None else project_storage.of(engine, who.project_id)
    project = ProjectUsage(name=who.project or "", bytes=used, objects=objects)
    return StoragePublic(store=None, kinds={}, project=project, measured_at=measured_at(usage), rules=rules(settings))


# A plain def: a pass lists the whole store and deletes, so it runs in the thread pool.
@router.post("/collect", response_model=CollectionPublic, operation_id="collect_storage", responses=FORBIDDEN)
def collect_storage(request: Request, engine: EngineDep, settings: SettingsDep, who: AdminDep) -> CollectionPublic:
    """Run the collector now: apply the retention rules, remove every object no row references (older than
    TRAINYARD_COLLECT_GRACE_S), and measure the store. Safe beside the periodic pass and running jobs. Admins
    only."""
    report = collector.collect(engine, settings)
    audit.record(engine, who, "collect", "storage", client_address(request),
                 {"deleted_objects": report.deleted_objects, "deleted_bytes": report.deleted_bytes})
    return CollectionPublic(**{**report.as_dict(), "usage": kinds(report.usage)},
                            measured_at=measured_at(report.usage))


def kinds(usage: list[collector.Usage]) -> dict[str, KindUsage]:
    """{kind: its bytes and objects}, in collector.KINDS' order, every kind there (0 where unmeasured)."""
    got = {u.kind: KindUsage(bytes=u.bytes, objects=u.objects) for u in usage}
    return {kind: got.get(kind, KindUsage(bytes=0, objects=0)) for kind in collector.KINDS}


def measured_at(usage: list[collector.Usage]) -> datetime | None:
    return ts(max((u.measured_at for u in usage if u.measured_at is not None), default=None))


def rules(settings: Settings) -> StorageRules:
    return StorageRules(**{name: getattr(settings, name) for name in StorageRules.model_fields})
