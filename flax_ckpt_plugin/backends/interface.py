"""The storage seam: what a storage backend does, and the files it hands out.

One `Backend` per kind of storage (`local`: a disk, and a file system in
memory; `object_store`: `s3://`, `gs://`...), picked once per directory by
the path's scheme (`for_path`) from the table the implementations register
in (`backend`, which the package imports), as etils' `epath` picks its
backends: callers ask the backend, and no module asks "is this path
local?". So the layers above need this module only, never an
implementation. A backend does the few things checkpoints need: write small files
durably, fsync, hold a directory's identity, create a step's data files
(`StepWriter`), read byte ranges (`RangedFile`), read small files with a
size cap, remove, delete a step so that a crash never leaves it looking
final, and set a damaged step aside. Tests inject faults by wrapping a
backend.
"""

from __future__ import annotations

import abc
import contextlib
import os
from typing import Any, BinaryIO, Callable, Iterator

from etils import epath

from flax_ckpt_plugin.errors import CheckpointCorruptedError

Identity = tuple[int, int]  # (st_dev, st_ino) of a local directory.
# The most bytes `read_small` takes of a commit marker, `_WRITER` or
# `_ATTEMPT` (each holds a line of JSON or a token).
MAX_MARKER_BYTES = 64 << 10


class RangedFile(abc.ABC):
  """An open data file that threads read by offset at once."""

  size: int

  @abc.abstractmethod
  def read_into(self, offset: int, out: memoryview) -> int:
    """Reads into `out` from `offset`; the bytes read (short only at the end)."""

  @contextlib.contextmanager
  def mapped(self, offset: int, size: int) -> Iterator[memoryview | None]:
    """The bytes at [offset, offset + size) as a read-only view of the
    file's pages, valid inside the context; None where the storage maps
    nothing (then `read_into`)."""
    del offset, size
    yield None

  def pinned_array(self, offset: int, size: int) -> Any:
    """The `jax.Array` in pinned host memory whose bytes are exactly
    [offset, offset + size) of the file, where the storage holds one (the
    snapshot a save wrote the file from: `held`); else None. A restore
    sends it to the device as it is, with the bytes checked through
    `mapped`."""
    del offset, size
    return None

  @abc.abstractmethod
  def close(self) -> None:
    ...


class StepWriter(abc.ABC):
  """Creates one process's files in a step directory (see `Backend`)."""

  # Whether files from `open` have descriptors written by offset (pwrite);
  # otherwise they are streams, written front to back.
  positional = False

  @abc.abstractmethod
  def open(self, name: str) -> BinaryIO:
    """A binary file for writing at `name` (relative to the step directory)."""

  def open_direct(self, name: str) -> int | None:
    """A second, O_DIRECT descriptor of `name` (opened by `open` first).

    None where the storage has no direct I/O.
    """
    del name
    return None

  def mapping(self, f: BinaryIO, size: int) -> memoryview | None:
    """A writable view of the first `size` bytes of `f` (from `open`), to
    copy into instead of writing; None where writes are better."""
    del f, size
    return None

  def sync(self, f: BinaryIO) -> None:
    """Makes what was written to `f` durable (before it is closed)."""
    del f

  def close(self) -> None:
    pass


class Backend(abc.ABC):
  """One kind of storage. Stateless: one instance serves every directory."""

  # Whether a directory can be renamed atomically ('auto' atomicity then
  # writes `<step>.partial` and renames it; otherwise a commit file).
  rename_is_atomic: bool
  # Whether each read is a request (restore then fetches the span of blocks
  # around many small ranges in one read).
  reads_are_requests: bool
  # Whether retention deletes steps in the background, off the save's path
  # (see `manager.deletions`); False where a delete must be done before
  # the next save begins (a file system in memory hands the deleted step's
  # data file to the next save's snapshot).
  deletes_in_background: bool = True

  @abc.abstractmethod
  def as_path(self, given: str) -> epath.Path:
    """The `epath.Path` this package reads and writes `given` through."""

  @abc.abstractmethod
  def write_small(self, path: epath.Path, text: str) -> None:
    """Writes a small file durably."""

  @abc.abstractmethod
  def replace_small(self, path: epath.Path, text: str) -> None:
    """Replaces a small file all at once: a reader sees old or new, whole."""

  def fsync(self, path: epath.Path) -> None:
    """Makes a file's or a directory's entries durable."""
    del path

  def hold(self, path: epath.Path) -> tuple[int | None, Identity | None]:
    """An open handle that pins directory `path`, and its identity.

    Where storage has identities (inodes), a directory made anew under the
    same name by another writer is never taken for this one.
    """
    del path
    return None, None

  def identity(self, path: epath.Path) -> Identity | None:
    """The identity of directory `path` now (FileNotFoundError if gone)."""
    del path
    return None

  def release(self, handle: int | None) -> None:
    """Closes a handle from `hold`."""
    del handle

  @abc.abstractmethod
  def step_writer(self, step_dir: epath.Path, identity: Identity | None,
                  data_dir: str) -> StepWriter:
    """This process's writer of files under `step_dir/data_dir`.

    Raises:
      ConcurrentWriterError: `step_dir` is no longer the directory with
        `identity` (another writer replaced it).
    """

  @abc.abstractmethod
  def open_ranged(self, path: epath.Path, within: epath.Path) -> RangedFile:
    """Opens a data file for ranged reads.

    Raises:
      FileNotFoundError: no such file.
      CheckpointCorruptedError: it is no regular file, or it leads outside
        `within` (the step directory).
      OSError: it cannot be read (permissions, I/O).
    """

  def read_small(self, path: epath.Path, *, within: epath.Path,
                 limit: int) -> bytes:
    """Reads a small file (manifest, marker, claim) whole, never unbounded.

    Never blocks on a named pipe and never follows a link out of `within`
    (this default, for storage without either, reads at most `limit + 1`
    bytes through `epath`).

    Raises:
      FileNotFoundError: no such file.
      CheckpointCorruptedError: it is no regular file, leads outside
        `within`, or holds more than `limit` bytes; the message names it.
      OSError: it cannot be read (permissions, I/O).
    """
    del within
    with path.open("rb") as f:
      data = f.read(limit + 1)
    if len(data) > limit:
      raise CheckpointCorruptedError(f"{path}: over the limit of {limit} bytes")
    return data

  def prefetch(self, directory: epath.Path, path: epath.Path,
               quiet_secs: float = 0.0) -> None:
    """Reads a final data file of `directory` back into memory, in the
    background, where a restore would otherwise read it from slower
    storage, once `quiet_secs` passed with no save beginning there; by
    default nothing."""
    del directory, path, quiet_secs

  def close_directory(self, directory: epath.Path, *,
                      wrote: bool = False, leaving: bool = False) -> None:
    """Lets go of what was kept for `directory` (its manager closed); if
    that manager `wrote` (not read-only), what its saves left to do in the
    background is done now (or never). `leaving`: the process is about to
    go (a preemption stop, an error): what would only help a later run on
    this machine is not done, and stops if it runs."""
    del directory, wrote, leaving

  def staging_arena(self, directory: epath.Path) -> object | None:
    """Where snapshots for `directory` are taken, when one process alone
    writes it (`memfile.SpareArena`); None: the manager's own memory."""
    del directory
    return None

  def remove(self, path: epath.Path) -> None:
    """Removes a file or a directory tree, if it exists."""
    if path.is_dir():
      path.rmtree(missing_ok=True)
    elif path.exists():
      path.unlink(missing_ok=True)

  @abc.abstractmethod
  def delete_step(self, directory: epath.Path, step: int) -> None:
    """Deletes a finalized step so that a crash half way never looks final.

    A step already gone (pruned by a person or `flax-ckpt prune`) is fine.
    """

  def delete_step_in_parts(self, directory: epath.Path, step: int
                           ) -> Iterator[None]:
    """`delete_step`, a part at a time: each `next` sends some of its
    requests, so that a caller may hold the rest back (retention's deletes
    wait while a save commits, see `manager.deletions`). The first part
    takes the step out of the list, as `delete_step` does. By default one
    part, the whole delete."""
    self.delete_step(directory, step)
    yield

  @abc.abstractmethod
  def set_aside(self, directory: epath.Path, step: int) -> str:
    """Takes a damaged finalized step out of the list; says where it went."""

  @abc.abstractmethod
  def size_and_mtime(self, path: epath.Path) -> tuple[int, float]:
    """Bytes and modification time of one file (FileNotFoundError if gone)."""


# The backends by scheme (None: a path without `scheme://`), and the one for
# other schemes; `backend` fills them when the package is imported.
_BY_SCHEME: dict[str | None, Backend] = {}
_OTHER: list[Backend] = []
# (whether a local path is on a file system in memory, its backend).
_IN_MEMORY: list[tuple[Callable[[epath.PathLike], bool], Backend]] = []


def scheme(path: epath.PathLike) -> str | None:
  """'s3' for `s3://bucket/x`; None for local paths."""
  text = os.fspath(path)
  return text.split("://", 1)[0] if "://" in text else None


def register(backend: Backend, scheme_name: str | None = None, *,
             other: bool = False) -> None:
  """Makes `backend` the one of paths of `scheme_name` (None: local paths),
  or, with `other`, of the schemes no backend names."""
  if other:
    _OTHER[:] = [backend]
  else:
    _BY_SCHEME[scheme_name] = backend


def register_in_memory(backend: Backend,
                       test: Callable[[epath.PathLike], bool]) -> None:
  """Makes `backend` the one of local paths that `test` finds on a file
  system in memory, for directories of one process alone
  (`for_own_path`)."""
  _IN_MEMORY[:] = [(test, backend)]


def for_own_path(path: epath.PathLike) -> Backend:
  """The backend of a local directory that one process alone writes (the
  local tier's): the in-memory one on a file system in memory."""
  for test, backend in _IN_MEMORY:
    if test(path):
      return backend
  return for_path(path)


def make_path(given: epath.PathLike, backend: Backend | None = None
              ) -> tuple[epath.Path, Backend]:
  """`given` as the path this package uses, and its backend (by default,
  the one its scheme names)."""
  backend = backend or for_path(given)
  return backend.as_path(os.fspath(given)), backend


def for_path(path: epath.PathLike) -> Backend:
  """The backend of the storage that `path` names."""
  found = _BY_SCHEME.get(scheme(path))
  if found is not None:
    return found
  if not _OTHER:
    raise ValueError(f"no storage backend takes {os.fspath(path)!r}")
  return _OTHER[0]
