"""Alembic migrations of trainyard's database (app/migrate.py runs them; `trainyard db upgrade`)."""
