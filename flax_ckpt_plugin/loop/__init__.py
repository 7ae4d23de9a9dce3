"""The training loop's side: `CheckpointCallback`, when it saves (triggers), preemption signals, and the tiers it saves through and restores from."""
