"""app/fleet: placement, fair share, preemption, spreading, the fleet, dependencies, the claim."""
