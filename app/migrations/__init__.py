"""Alembic migrations of trainyard's database (app/schema.py runs them; `trainyard db upgrade`)."""
