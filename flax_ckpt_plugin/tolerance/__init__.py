"""Faults: preemption, noticing a lost process, the survivors' rescue save, going on in place, taking a process back from its peers, and the local tier."""
