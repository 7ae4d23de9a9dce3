"""Data files on a file system in memory (tmpfs, ramfs), written through
mappings kept from save to save.

On tmpfs a file's pages are memory. Writing 1 GB into them with `pwrite`
took 0.19 s here, a copy into a mapping of the same pages 0.07 s: the
kernel looks up and locks each page on every write, while a mapping that
already points at the pages is plain memory. Mapping them anew costs as
much again (0.10 s per GB with MAP_POPULATE, 0.37 s page fault by page
fault), so a mapping is kept after its save: the next save that writes
the same file (a deleted step's, see `SPARE_FILE`) copies into it at
memory speed. The local tier's steps rotate through three files (two kept
steps and the one being written), so a few mappings cover them.

A kept mapping holds its file's pages even after the file is unlinked;
mappings of files that are gone are dropped whenever a mapping is asked
for and when a step is deleted, and `release` drops a directory's. The
mapped pages count in the process's resident set (as shared memory): they
are the files' own pages, not a copy.
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
from typing import BinaryIO

from etils import epath
import numpy as np

from flax_ckpt_plugin.backends import handles
from flax_ckpt_plugin.backends import interface

# Where a deleted step's data file waits for the next save, beside the
# steps (never a step's name, so never listed nor cleaned up).
SPARE_FILE = "_spare.bin"
# Mappings kept per process, all directories together: three rotate in one
# local tier; a fourth spares them from a second tier in the same process.
KEPT_MAPPINGS = 4

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class _Mapping:

  def __init__(self, fd: int, length: int, directory: str):
    self.fd = os.dup(fd)  # To notice the file unlinked (st_nlink 0).
    try:
      self.map = mmap.mmap(self.fd, length, flags=mmap.MAP_SHARED | _POPULATE)
    except BaseException:
      os.close(self.fd)
      raise
    self.length, self.directory = length, directory

  def gone(self) -> bool:
    return os.fstat(self.fd).st_nlink == 0

  def close(self) -> None:
    try:
      self.map.close()
    except BufferError:  # A view of it still lives: the GC unmaps it later.
      pass
    os.close(self.fd)


class _Mappings:
  """The mappings kept, newest used last, keyed by (st_dev, st_ino)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._maps: collections.OrderedDict[tuple[int, int], _Mapping] = (
        collections.OrderedDict())

  def get(self, fd: int, size: int, directory: str) -> memoryview:
    """A writable view of the first `size` bytes of the file `fd` (opened
    for reading and writing), at least `size` long from now on, its pages
    allocated. Release the view when done."""
    self.sweep()  # First: their pages may be what this file needs.
    st = os.fstat(fd)
    if st.st_size < size or st.st_blocks * 512 < st.st_size:
      # Every page is allocated before it is mapped: a full file system
      # is then an error here (ENOSPC), not a SIGBUS at a write into a
      # hole. (A file this package wrote has no holes, and allocating the
      # pages it has would cost 0.12 s per GB.)
      os.posix_fallocate(fd, 0, size)
    key = (st.st_dev, st.st_ino)
    with self._lock:
      kept = self._maps.pop(key, None)
      if kept is not None and kept.length < size:
        kept.close()
        kept = None
      if kept is None:
        kept = _Mapping(fd, size, directory)
      self._maps[key] = kept
      while len(self._maps) > KEPT_MAPPINGS:
        self._maps.popitem(last=False)[1].close()
      return memoryview(kept.map)[:size]

  def sweep(self) -> None:
    """Drops the mappings of files that are gone."""
    with self._lock:
      self._drop(lambda k, m: m.gone())

  def release(self, directory: str) -> None:
    """Drops the mappings of files written under `directory`."""
    with self._lock:
      self._drop(lambda k, m: m.directory == directory)

  def __len__(self) -> int:
    return len(self._maps)

  def _drop(self, doomed) -> None:
    for key, m in list(self._maps.items()):
      if doomed(key, m):
        del self._maps[key]
        m.close()


MAPPINGS = _Mappings()


class SpareArena:
  """Staging memory for a directory that one process alone writes (a
  local tier): the pages of the file its next save's data file will be.

  The snapshot copies each CPU shard straight into the mapped spare file,
  at the offset the writer will place it (`datafile.DataFile` puts shards
  one after another in snapshot order), and the writer, finding the bytes
  already in place, copies nothing: one copy per save instead of two. If
  the writer gets another file after all, it copies from these buffers.
  Never for a directory that several processes write: they would share
  the spare file.
  """

  def __init__(self, directory: epath.Path):
    self._dir = os.fspath(directory)

  def buffers(self, srcs: list[np.ndarray]) -> list[np.ndarray] | None:
    """A buffer shaped like each source, one after another in the spare
    file's mapping; None if the file cannot hold them."""
    total = sum(s.nbytes for s in srcs)
    if not total:
      return None
    try:
      fd = os.open(os.path.join(self._dir, SPARE_FILE),
                   os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
      try:
        view = MAPPINGS.get(fd, total, self._dir)
      finally:
        os.close(fd)
    except OSError:  # No directory yet (the first save makes it), or full:
      return None  # the manager's own memory then, and the writer's error.
    flat = np.frombuffer(view, np.uint8)
    out, offset = [], 0
    for src in srcs:
      out.append(flat[offset:offset + src.nbytes].view(src.dtype).reshape(
          src.shape))
      offset += src.nbytes
    return out


class MemoryStepWriter(handles.LocalStepWriter):
  """Never syncs; a data file reuses a deleted step's pages when there is
  one, and is written through a kept mapping (see the module doc)."""

  def __init__(self, step_dir: epath.Path, identity: interface.Identity | None,
               data_dir: str):
    super().__init__(step_dir, identity, data_dir)
    self._tier_dir = os.fspath(step_dir.parent)
    self._spare = step_dir.parent / SPARE_FILE

  def open(self, name: str) -> BinaryIO:
    if not name.endswith(".bin"):
      return super().open(name)
    try:  # Its pages are in memory already: overwritten, not allocated.
      os.rename(os.fspath(self._spare), self._base(name),
                dst_dir_fd=self._data_fd)
      flags = os.O_RDWR | os.O_CLOEXEC
    except FileNotFoundError:
      flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    fd = os.open(self._base(name), flags, 0o644, dir_fd=self._data_fd)
    return open(fd, "r+b", buffering=0)

  def open_direct(self, name: str) -> int | None:
    del name  # (tmpfs takes O_DIRECT since Linux 6.6: a copy all the same.)
    return None

  def mapping(self, f: BinaryIO, size: int) -> memoryview | None:
    if not size:
      return None
    return MAPPINGS.get(f.fileno(), size, self._tier_dir)

  def sync(self, f: BinaryIO) -> None:
    del f
