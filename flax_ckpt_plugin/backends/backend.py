"""Storage backends: what a local file system and an object store each do.

One `Backend` per kind of storage, picked once per directory from a table by
the path's scheme (`for_path`), as etils' `epath` picks its backends: callers
ask the backend, and no module asks "is this path local?". A backend does the
few things checkpoints need: write small files durably, fsync, hold a
directory's identity, create a step's data files, read byte ranges, read
small files with a size cap, remove, delete a step so that a crash never
leaves it looking final, and set a damaged step aside. Tests inject faults
by wrapping a backend.
"""

from __future__ import annotations

import abc
import os
import threading
import time
import uuid
from typing import BinaryIO

from etils import epath

from flax_ckpt_plugin.backends import handles
from flax_ckpt_plugin.backends import layout
from flax_ckpt_plugin.backends import memfile
from flax_ckpt_plugin.backends import object_store
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.logs import log

Identity = handles.Identity
RangedFile = handles.RangedFile
StepWriter = handles.StepWriter
# The most bytes `read_small` takes of a commit marker, `_WRITER` or
# `_ATTEMPT` (each holds a line of JSON or a token).
MAX_MARKER_BYTES = 64 << 10
# The longest a closing manager waits for its newest step's reading back
# into the page cache to be asked for (`LocalBackend(cache_saved=True)`).
READ_BACK_WAIT_SECS = 10.0


class Backend(abc.ABC):
  """One kind of storage. Stateless: one instance serves every directory."""

  # Whether a directory can be renamed atomically ('auto' atomicity then
  # writes `<step>.partial` and renames it; otherwise a commit file).
  rename_is_atomic: bool
  # Whether each read is a request (restore then fetches the span of blocks
  # around many small ranges in one read).
  reads_are_requests: bool

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

  def prefetch(self, path: epath.Path, quiet_secs: float = 0.0) -> None:
    """Reads a final data file back into memory, in the background, where a
    restore would otherwise read it from slower storage, once `quiet_secs`
    passed with no save beginning; by default nothing."""
    del path, quiet_secs

  def close_directory(self, directory: epath.Path) -> None:
    """Lets go of what was kept for `directory` (its manager closed)."""
    del directory

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

  @abc.abstractmethod
  def set_aside(self, directory: epath.Path, step: int) -> str:
    """Takes a damaged finalized step out of the list; says where it went."""

  @abc.abstractmethod
  def size_and_mtime(self, path: epath.Path) -> tuple[int, float]:
    """Bytes and modification time of one file (FileNotFoundError if gone)."""


# -- local file systems ----------------------------------------------------------


class LocalBackend(Backend):
  """POSIX file systems: fsync, atomic rename, inodes as identities.

  Args:
    direct_io: write large shards with direct I/O (`O_DIRECT`) where the
      file system takes it (the default). A save then becomes durable
      sooner and costs no copy into the page cache, but its files are not
      in the page cache afterwards: a restore on the same machine reads
      the disk. With False every byte goes through the page cache, so a
      job that restarts on the machine that wrote its checkpoint restores
      from memory, at the cost of a slower save to durable (see
      docs/performance.md, *Accelerators*, for both measured).
    cache_saved: once a step written with direct I/O is final, have the
      kernel read its data files back into the page cache in the background
      (the default): a job that restarts on this machine then restores from
      memory, as it would after a save through the page cache, while the
      save itself stays as fast to become durable. It costs one read of the
      step from the disk, done by the disk (no copy; the page cache gives
      the memory back when it needs it), after a quiet spell as long as the
      save's commit; a save that begins first drops it, so saves that
      follow each other closely are not slowed, and a closing manager has
      its newest step read back at once. False leaves the files on the disk
      only.
  """

  rename_is_atomic = True
  reads_are_requests = False
  # (Also for subclasses whose __init__ skips this one's.)
  direct_io = True
  cache_saved = True

  def __init__(self, *, direct_io: bool = True, cache_saved: bool = True):
    self.direct_io = direct_io
    self.cache_saved = cache_saved

  def as_path(self, given: str) -> epath.Path:
    return epath.Path(os.path.abspath(given))

  def write_small(self, path: epath.Path, text: str) -> None:
    with open(os.fspath(path), "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())

  def replace_small(self, path: epath.Path, text: str) -> None:
    prefix = path.name + "."
    for entry in path.parent.iterdir():  # Left by a crash inside a replace.
      if entry.name.startswith(prefix):
        entry.unlink(missing_ok=True)
    tmp = path.parent / f"{prefix}{uuid.uuid4().hex}"
    self.write_small(tmp, text)
    os.replace(os.fspath(tmp), os.fspath(path))
    self.fsync(path.parent)

  def fsync(self, path: epath.Path) -> None:
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)

  def hold(self, path: epath.Path) -> tuple[int | None, Identity | None]:
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    st = os.fstat(fd)
    return fd, (st.st_dev, st.st_ino)

  def identity(self, path: epath.Path) -> Identity | None:
    st = os.stat(os.fspath(path))
    return st.st_dev, st.st_ino

  def release(self, handle: int | None) -> None:
    if handle is not None:
      os.close(handle)

  def step_writer(self, step_dir: epath.Path, identity: Identity | None,
                  data_dir: str) -> StepWriter:
    _READ_AHEAD.stop()  # The disk writes this save rather than read back.
    return handles.LocalStepWriter(step_dir, identity, data_dir,
                                   direct_io=self.direct_io)

  def open_ranged(self, path: epath.Path, within: epath.Path) -> RangedFile:
    fd, size = handles.open_regular(path, within, f"data file {path}",
                                    "the step directory")
    return handles.LocalFile(fd, size)

  def read_small(self, path: epath.Path, *, within: epath.Path,
                 limit: int) -> bytes:
    return handles.read_regular(path, within, limit)

  def prefetch(self, path: epath.Path, quiet_secs: float = 0.0) -> None:
    if self.direct_io and self.cache_saved:
      _READ_AHEAD.start(os.fspath(path), quiet_secs)

  def close_directory(self, directory: epath.Path) -> None:
    # So that a process exiting right after its last save has that step
    # read back: asking takes about as long as the disk's reading, and
    # what was asked for is read after the process is gone.
    _READ_AHEAD.finish(os.fspath(directory), READ_BACK_WAIT_SECS)

  def remove(self, path: epath.Path) -> None:
    if os.path.islink(os.fspath(path)):
      os.unlink(os.fspath(path))  # The link only, never what it points to.
      return
    super().remove(path)

  def delete_step(self, directory: epath.Path, step: int) -> None:
    # Renamed first (atomic), so a crash leaves `<step>.deleting`, which is
    # unfinished, never a half-deleted step that still looks final.
    doomed = directory / f"{step}{layout.DELETING_SUFFIX}"
    self.remove(doomed)
    try:
      (directory / str(step)).rename(doomed)
    except FileNotFoundError:
      return  # Already gone: retention wanted that too.
    self.fsync(directory)
    self.remove(doomed)

  def set_aside(self, directory: epath.Path, step: int) -> str:
    # Kept for a person to look at: neither a step nor unfinished, so never
    # listed and never removed.
    aside = directory / f"{step}{layout.DAMAGED_SUFFIX}"
    n = 1
    while aside.exists():
      n += 1
      aside = directory / f"{step}{layout.DAMAGED_SUFFIX}{n}"
    (directory / str(step)).rename(aside)
    self.fsync(directory)
    return str(aside)

  def size_and_mtime(self, path: epath.Path) -> tuple[int, float]:
    st = os.lstat(os.fspath(path))
    return st.st_size, st.st_mtime


SPARE_FILE = memfile.SPARE_FILE


class MemoryBackend(LocalBackend):
  """A local file system that lives in memory (tmpfs, ramfs: `/dev/shm`).

  Its files are gone with the machine whatever fsync does, and they are
  written once a write returns, so nothing here fsyncs: on such a path the
  order of writes and the atomic rename alone make a step all or nothing.
  And a step that retention deletes leaves its data file for the next
  save to overwrite in place: new pages of a file in memory cost more to
  allocate and free than the copy itself (measured: a 1 GB write into a
  new file on tmpfs took 0.45 s, into the pages of an old one 0.19 s, and
  unlinking it 0.14 s). Data files are written through mappings kept from
  save to save (`memfile`): a copy into mapped pages took 0.07 s per GB.
  """

  def write_small(self, path: epath.Path, text: str) -> None:
    with open(os.fspath(path), "w", encoding="utf-8") as f:
      f.write(text)

  def fsync(self, path: epath.Path) -> None:
    del path

  def step_writer(self, step_dir: epath.Path, identity: Identity | None,
                  data_dir: str) -> StepWriter:
    return memfile.MemoryStepWriter(step_dir, identity, data_dir)

  def prefetch(self, path: epath.Path, quiet_secs: float = 0.0) -> None:
    del path, quiet_secs  # Its files are in memory.

  def delete_step(self, directory: epath.Path, step: int) -> None:
    doomed = directory / f"{step}{layout.DELETING_SUFFIX}"
    self.remove(doomed)
    try:  # First: from now on it is not a step (see `LocalBackend`).
      (directory / str(step)).rename(doomed)
    except FileNotFoundError:
      return
    files = sorted((doomed / layout.DATA_DIR).glob("*.bin")) if (
        doomed / layout.DATA_DIR).is_dir() else []
    if files and os.stat(os.fspath(files[-1])).st_nlink == 1:
      # (A file linked elsewhere too, a copy made with hard links, is
      # never written over.)
      os.replace(os.fspath(files[-1]), os.fspath(directory / SPARE_FILE))
    self.remove(doomed)
    memfile.MAPPINGS.sweep()

  def close_directory(self, directory: epath.Path) -> None:
    memfile.MAPPINGS.release(os.fspath(directory))

  def staging_arena(self, directory: epath.Path) -> memfile.SpareArena:
    return memfile.SpareArena(directory)


class _ReadAhead:
  """The threads asking the kernel to read saved data files back.

  A save's writes come first. Reading a step back starts only after a quiet
  spell (as long as its save took to commit) with no save beginning: a save
  that begins drops the reads of older steps not yet asked for, whose reads
  would slow its writes and which it makes stale. A manager that closes
  (a process exiting after its last save) has its newest step read back
  at once.
  """

  def __init__(self):
    self._lock = threading.Lock()
    # path: (thread, stop: drop the rest, now: end the quiet spell)
    self._reads: dict[str, tuple[threading.Thread, threading.Event,
                                 threading.Event]] = {}

  def start(self, path: str, quiet_secs: float) -> None:
    stop, now = threading.Event(), threading.Event()
    thread = threading.Thread(target=self._read,
                              args=(path, quiet_secs, stop, now),
                              name="flax_ckpt_read_ahead", daemon=True)
    with self._lock:
      self._reads[path] = thread, stop, now
    thread.start()

  def stop(self) -> None:
    with self._lock:
      for _, stop, now in self._reads.values():
        stop.set()
        now.set()  # (Its thread then ends, having read nothing.)

  def _read(self, path: str, quiet_secs: float, stop: threading.Event,
            now: threading.Event) -> None:
    try:
      now.wait(quiet_secs)
      handles.read_ahead(path, stopped=stop.is_set)
    except OSError as e:  # Deleted meanwhile, say: only a restore is slower.
      log.debug("reading %s back into the page cache: %s", path, e)
    finally:
      with self._lock:
        if self._reads.get(path, (None,))[0] is threading.current_thread():
          del self._reads[path]

  def finish(self, directory: str, timeout: float) -> None:
    """Reads files under `directory` back now, waiting (at most `timeout`
    seconds) until every read is asked for."""
    deadline = time.monotonic() + timeout
    with self._lock:
      reads = [r for p, r in self._reads.items()
               if p.startswith(directory + os.sep)]
    for thread, _, now in reads:
      now.set()
      thread.join(max(0.0, deadline - time.monotonic()))


_READ_AHEAD = _ReadAhead()


_MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")


def file_system_type(path: epath.PathLike) -> str | None:
  """The type of the local file system that holds `path` (or would hold
  it: its nearest existing parent), from /proc/self/mounts; None if
  unknown."""
  real = os.path.realpath(os.fspath(path))
  try:
    with open("/proc/self/mounts", encoding="utf-8") as f:
      mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
  except OSError:
    return None
  best, kind = "", None
  for point, fs_type in mounts:
    point = point.replace("\\040", " ")
    if (real == point or real.startswith(point.rstrip("/") + "/")
        ) and len(point) >= len(best):
      best, kind = point, fs_type
  return kind


# -- object stores -----------------------------------------------------------------


class _ObjectStepWriter(StepWriter):
  """No directory to make or to hold: a prefix exists once an object under
  it does; each file is one object, uploaded when it is closed."""

  def __init__(self, step_dir: epath.Path):
    self._dir = object_store.as_path(step_dir)

  def open(self, name: str) -> BinaryIO:
    return (self._dir / name).open("wb")


class _ObjectFile(RangedFile):

  def __init__(self, path: epath.Path):
    self._file = object_store.ObjectFile(path)
    self.size = self._file.size

  def read_into(self, offset: int, out: memoryview) -> int:
    done = 0
    while done < len(out):  # A ranged GET stops short only at the end.
      n = self._file.read_into(offset + done, out[done:])
      if not n:
        break
      done += n
    return done

  def close(self) -> None:
    self._file.close()


class ObjectStoreBackend(Backend):
  """`gs://`, `s3://`... through fsspec: no rename, no fsync, no inodes.

  A PUT is atomic and durable once it returns, so small files need no more;
  a step is deleted commit marker first, so what is left of a crash half
  way is unfinished.
  """

  rename_is_atomic = False
  reads_are_requests = True

  def as_path(self, given: str) -> epath.Path:
    return object_store.as_path(given)

  def write_small(self, path: epath.Path, text: str) -> None:
    path.write_text(text)

  def replace_small(self, path: epath.Path, text: str) -> None:
    path.write_text(text)

  def step_writer(self, step_dir: epath.Path, identity: Identity | None,
                  data_dir: str) -> StepWriter:
    del identity, data_dir
    return _ObjectStepWriter(step_dir)

  def open_ranged(self, path: epath.Path, within: epath.Path) -> RangedFile:
    del within  # Object names cannot leave a prefix.
    return _ObjectFile(path)

  def read_small(self, path: epath.Path, *, within: epath.Path,
                 limit: int) -> bytes:
    del within  # Object names cannot leave a prefix.
    fs, url = object_store.filesystem(path), os.fspath(path)
    info = fs.info(url)  # FileNotFoundError if it is missing.
    if info.get("type") != "file":
      raise CheckpointCorruptedError(f"{path} is not a file")
    if info["size"] > limit:
      raise CheckpointCorruptedError(
          f"{path}: {info['size']} bytes, over the limit of {limit}")
    data = fs.cat_file(url, start=0, end=limit + 1)
    if len(data) > limit:  # Replaced by a larger object meanwhile.
      raise CheckpointCorruptedError(f"{path}: over the limit of {limit}")
    return data

  def delete_step(self, directory: epath.Path, step: int) -> None:
    step_dir = directory / str(step)
    (step_dir / layout.COMMIT_MARKER).unlink(missing_ok=True)
    self.remove(step_dir)

  def set_aside(self, directory: epath.Path, step: int) -> str:
    # Without its marker the step is unfinished; the next writer cleans up.
    (directory / str(step) / layout.COMMIT_MARKER).unlink(missing_ok=True)
    return "unfinished (its commit marker was removed)"

  def size_and_mtime(self, path: epath.Path) -> tuple[int, float]:
    st = path.stat()
    return st.length, float(st.mtime)


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
  return MEMORY if file_system_type(path) in _MEMORY_FILE_SYSTEMS else LOCAL


def make_path(given: epath.PathLike, backend: Backend | None = None
              ) -> tuple[epath.Path, Backend]:
  """`given` as the path this package uses, and its backend (by default,
  the one its scheme names)."""
  backend = backend or for_path(given)
  return backend.as_path(os.fspath(given)), backend

