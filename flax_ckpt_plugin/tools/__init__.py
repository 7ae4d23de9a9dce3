"""The command line and what it runs: listing, verifying, exporting and importing checkpoints."""
