"""Restoring a step into a target pytree: reading and checking bytes, matching and casting, placing on devices, the newest-valid fallback, and restores read once and shared."""
