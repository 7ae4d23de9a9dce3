"""Storage backends: the one each path names, by its scheme.

One `interface.Backend` per kind of storage, picked once per directory from
a table by the path's scheme (`for_path`), as etils' `epath` picks its
backends: callers ask the backend, and no module asks "is this path local?".
The kinds: local file systems (`local`: a disk, and a file system in
memory) and object stores (`object_store`). Their classes are named here
too, so that a caller imports this module alone.
"""

from __future__ import annotations

import os

from etils import epath

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
# The most bytes `read_small` takes of a commit marker, `_WRITER` or
# `_ATTEMPT` (each holds a line of JSON or a token).
MAX_MARKER_BYTES = 64 << 10

LOCAL = LocalBackend()
MEMORY = MemoryBackend()
OBJECT_STORE = ObjectStoreBackend()

# By scheme (None: no `scheme://`). Other schemes go to whatever `epath`
# makes of them, as object stores.
_BACKENDS: dict[str | None, Backend] = {None: LOCAL}


def for_path(path: epath.PathLike) -> Backend:
  """The backend of the storage that `path` names."""
  return _BACKENDS.get(object_store.scheme(path), OBJECT_STORE)


def for_local_path(path: epath.PathLike) -> Backend:
  """The backend of a local path: `MEMORY` on a file system in memory."""
  return MEMORY if local.in_memory(path) else LOCAL


def make_path(given: epath.PathLike, backend: Backend | None = None
              ) -> tuple[epath.Path, Backend]:
  """`given` as the path this package uses, and its backend (by default,
  the one its scheme names)."""
  backend = backend or for_path(given)
  return backend.as_path(os.fspath(given)), backend
