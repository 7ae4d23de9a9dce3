"""What a step holds: the manifest and its typed records, tree paths, data states, and each process's files."""
