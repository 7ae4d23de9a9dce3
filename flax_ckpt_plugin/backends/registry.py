"""Storage backends: the table of the one each path names, by its scheme.

One `interface.Backend` per kind of storage, registered here in the
interface's table by scheme (`interface.for_path`), as etils' `epath`
picks its backends: callers ask the backend, and no module asks "is this
path local?". The kinds: local file systems (`local`: a disk, and a file
system in memory) and object stores (`object_store`). The package imports
this module, so the table is full before any path is looked up; the
classes are named here too, for the layers that choose a backend (the
manager, the tools).
"""

from __future__ import annotations



from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.backends import local
from flax_ckpt_plugin.backends import object_store

Backend = interface.Backend
Identity = interface.Identity
RangedFile = interface.RangedFile
StepWriter = interface.StepWriter
LocalBackend = local.LocalBackend
MemoryBackend = local.MemoryBackend
ObjectStoreBackend = object_store.ObjectStoreBackend
SPARE_FILE = local.SPARE_FILE

LOCAL = LocalBackend()
MEMORY = MemoryBackend()
OBJECT_STORE = ObjectStoreBackend()

# Local paths (no `scheme://`) are files; other schemes go to whatever
# `epath` makes of them, as object stores.
interface.register(LOCAL, None)
interface.register(OBJECT_STORE, other=True)
interface.register_in_memory(MEMORY, local.in_memory)
for_path = interface.for_path
for_own_path = interface.for_own_path
make_path = interface.make_path
