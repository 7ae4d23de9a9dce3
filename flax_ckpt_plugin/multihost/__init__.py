"""Processes that meet: the coordinator (barriers, the key-value store, deadlines) and groups of processes other than the whole job."""
