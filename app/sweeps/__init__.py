"""Sweeps: the sweep store (the only code that writes a sweep's row), sweep admission, the driver (search),
the Optuna study, trial outcomes and learning curves.

May import: core, db, spec, accounts, records, jobs (a sweep's trials are jobs)."""
