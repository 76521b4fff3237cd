"""Jobs through their states: the queue (the only code that changes a job's state), submit, admission,
exports and a job's event stream.

May import: core, db, spec, accounts, records, uploads, fleet."""
