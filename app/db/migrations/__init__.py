"""Alembic migrations of trainyard's database (app/db/migrate.py runs them; `trainyard db upgrade`)."""
