"""Clusters that trainyard runs jobs on without owning their machines: Slurm (slurm: its commands as argument
lists, its answers parsed; agent: `trainyard slurm-agent`'s loop, one allocation per job that runs there, its
workers bound to that job). Torch-free.

May import: core, db, spec, accounts, records, fleet, lifecycle, jobs, sweeps."""
