"""CheckpointManager: numbered steps in one directory, their retention, and when to save."""
