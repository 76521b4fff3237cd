"""The server's background duties: the threads that run the lease reaper, the sweeps' driver, the dependents'
pass, preemption and the collector (loops.py), one set per data directory.

May import: core, db, spec, accounts, records, fleet, lifecycle, jobs, sweeps."""
