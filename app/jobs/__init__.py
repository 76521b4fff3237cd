"""Jobs through their states: the queue (the only code that changes a job's state), submit, admission,
exports, a job's event stream and its TensorBoard event files as an archive (event_archive).

May import: core, db, spec, accounts, records, uploads, fleet."""
