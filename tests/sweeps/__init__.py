"""app/sweeps: sweeps, the driver, pruning, sweep limits."""
