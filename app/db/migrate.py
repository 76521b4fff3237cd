"""Migrating the database to this release's schema: Alembic migrations (app/db/migrations), run by `trainyard db
upgrade`.

The embedded SQLite database upgrades itself when a server or worker starts. A PostgreSQL database
is shared by hosts that may run different releases during a rollout, so it is upgraded only on
request: a server or worker that finds it behind refuses to start and names the command (an
empty database is simply created). Every upgrade runs in one transaction that holds the database's
write lock (SQLite) or an advisory lock (PostgreSQL): processes starting together upgrade it once.
A database made before migrations is first brought to the baseline (app/db/migrate_releases.py).
"""
import logging
from pathlib import Path
from types import ModuleType

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import func, inspect, select
from sqlalchemy.engine import Connection, Engine

from trainyard.app.db import write
from trainyard.app.db.migrate_releases import SchemaBehind, to_baseline

MIGRATIONS = Path(__file__).parent / "migrations"
BASELINE = "0001"  # the schema `create_all` made before migrations (app/db/migrations/versions/0001_baseline.py)
UPGRADE_COMMAND = "trainyard db upgrade"
# Alembic says at INFO which revisions it runs on every start of every process; say it ourselves, once.
logging.getLogger("alembic").setLevel(logging.WARNING)
log = logging.getLogger("trainyard.migrate")


def head() -> str:
    """This release's revision: the newest of app/db/migrations."""
    newest = ScriptDirectory.from_config(_config()).get_current_head()
    if newest is None:
        raise RuntimeError(f"no migrations in {MIGRATIONS}: this trainyard is installed without them")
    return newest


def current(engine: Engine) -> str | None:
    """The database's revision; the baseline for a database made before migrations; None when empty."""
    with engine.connect() as conn:
        return _revision(conn)


def upgrade(engine: Engine, to: str = "head") -> tuple[str | None, str]:
    """Upgrade to this release's schema (or to revision `to`): (revision before, revision after)."""
    with write(engine) as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(select(func.pg_advisory_xact_lock(func.hashtext("trainyard-schema"))))
        before = _revision(conn)
        if before is not None and MigrationContext.configure(conn).get_current_revision() is None:
            # Made by create_all before migrations: what that release's tables lack of the baseline is
            # added first (or the database refused), then it is the baseline.
            added = to_baseline(conn, _baseline_module())
            if added:
                log.warning("a database made before migrations: added %s", ", ".join(added))
            _run(conn, "stamp", BASELINE)
        _run(conn, "upgrade", to)
    return before, head() if to == "head" else to


def prepare(engine: Engine) -> None:
    """Make the database ready for this release, or raise SchemaBehind with what to run."""
    now, wanted = current(engine), head()
    if now == wanted:
        return
    if engine.dialect.name == "sqlite" or now is None:
        upgrade(engine)
        return
    raise SchemaBehind(f"the database's schema is at revision {now}, this trainyard needs {wanted}: back the "
                       f"database up, then run `{UPGRADE_COMMAND}` once (with TRAINYARD_DATABASE_URL set)")


def _revision(conn: Connection) -> str | None:
    version = MigrationContext.configure(conn).get_current_revision()
    if version is None and inspect(conn).has_table("jobs"):
        return BASELINE
    return version


def _baseline_module() -> ModuleType:
    script = ScriptDirectory.from_config(_config()).get_revision(BASELINE)
    if script is None:
        raise RuntimeError(f"no baseline revision {BASELINE} in {MIGRATIONS}")
    return script.module


def _run(conn: Connection, what: str, revision: str) -> None:
    cfg = _config()
    cfg.attributes["connection"] = conn
    getattr(command, what)(cfg, revision)


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg
