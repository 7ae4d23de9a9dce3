"""Arrays on devices and hosts, as saves and restores both handle them: copy programs, pinned host memory, and the division of each array's bytes among the processes."""
