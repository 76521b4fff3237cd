"""The fleet: the worker registry, placement (which queued job a slot may take, with which other devices), jobs
waiting on jobs as a placement condition, spreading a job across hosts, fair share, preemption, the plugin
catalogue, the /devices payload, the hardware readings (NVML, which GPU a device number is), why a queued job
waits, and an idle worker's look at the queue.

May import: core, db, spec, accounts, records."""
