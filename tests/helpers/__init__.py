"""What the tests share, by topic: a test file imports from here (or takes a fixture of tests/conftest.py), never
from another test file.

- service: the real service on a free port (Service, serving, live_service: a module's `live` fixture)
  and what a test reads of it over HTTP
- backends: SQLite and PostgreSQL (BACKENDS, on_both_backends, on_sqlite_only, on_postgres_only, fresh_database)
- jobs: tiny job presets; data: files to upload
- runner: a job run in this process or in a job process of its own, without a worker
- processes: whether a process lives, a job's process ids, memory of a process
- sweeps, teams, s3, prometheus, openapi, browser, docs, gpu_readings: the helpers of one topic each
"""
