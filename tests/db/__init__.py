"""app/db: the schema and its migrations, upgrades from old releases, PostgreSQL, wake-ups."""
