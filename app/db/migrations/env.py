"""Alembic's entry point: runs the revisions on the connection app/db/migrate.py hands over, inside its
transaction (so that a schema change is all or nothing, and serialised between processes)."""
from alembic import context

from trainyard.app.db import metadata

connection = context.config.attributes["connection"]
# render_as_batch: SQLite alters most things only by copying the table; Alembic's batch mode does that.
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True,
                  transactional_ddl=True)
with context.begin_transaction():
    context.run_migrations()
