"""Observability: Prometheus metrics (counters kept in the database, gauges read from the rows) as /metrics
serves them.

May import: core, db, spec, accounts, records, fleet, lifecycle."""
