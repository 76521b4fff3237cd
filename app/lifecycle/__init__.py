"""The storage lifecycle: retention, the collector, deletion, what refers to what, this host's caches and what
each project stores.

May import: core, db, spec, accounts, records, uploads."""
