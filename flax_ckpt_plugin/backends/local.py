"""Local file systems: a disk (`LocalBackend`: fsync, atomic rename, inodes
as identities, direct I/O, a saved step read back into the page cache) and
a file system in memory (`MemoryBackend`: tmpfs, `/dev/shm`).
"""

from __future__ import annotations

import os
import threading
import uuid

from etils import epath

from flax_ckpt_plugin import exits
from flax_ckpt_plugin.backends import handles
from flax_ckpt_plugin.backends import layout
from flax_ckpt_plugin.backends import memfile
from flax_ckpt_plugin.backends.interface import Backend
from flax_ckpt_plugin.backends.interface import Identity
from flax_ckpt_plugin.backends.interface import RangedFile
from flax_ckpt_plugin.backends.interface import StepWriter
from flax_ckpt_plugin.logs import log

# The longest a closing manager waits for its newest step's reading back
# into the page cache (`LocalBackend(cache_saved=True)`), unless the
# process is leaving (then it waits for none).
READ_BACK_WAIT_SECS = 10.0


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
      save's commit; a save that begins first in the same directory drops
      it, so saves that follow each other closely are not slowed; it runs
      at most 32 MB ahead of the disk, so a save that begins while it reads
      finds little queued before its writes; and a writer that closes
      normally has its newest step read back at once, waiting for it (at
      most `READ_BACK_WAIT_SECS`). A process that is leaving (a close
      after a preemption stop or an error, or the interpreter's exit)
      reads nothing back and stops what reads: its machine may be going
      away. False leaves the files on the disk only.
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
    # The disk writes this save rather than read back the step it makes
    # stale (a step directory's parent is the checkpoint directory).
    _READ_AHEAD.stop(os.path.dirname(os.fspath(step_dir)))
    return handles.LocalStepWriter(step_dir, identity, data_dir,
                                   direct_io=self.direct_io)

  def open_ranged(self, path: epath.Path, within: epath.Path) -> RangedFile:
    fd, size = handles.open_regular(path, within, f"data file {path}",
                                    "the step directory")
    return handles.LocalFile(fd, size)

  def read_small(self, path: epath.Path, *, within: epath.Path,
                 limit: int) -> bytes:
    return handles.read_regular(path, within, limit)

  def prefetch(self, directory: epath.Path, path: epath.Path,
               quiet_secs: float = 0.0) -> None:
    if self.direct_io and self.cache_saved:
      _READ_AHEAD.start(os.fspath(directory), os.fspath(path), quiet_secs)

  def close_directory(self, directory: epath.Path, *,
                      wrote: bool = False, leaving: bool = False) -> None:
    # So that a process exiting right after its last save has that step
    # read back: the disk's time to read it (where the kernel cannot
    # populate a mapping, pieces asked for are read after the process is
    # gone). Not when it leaves: a preempted machine's page cache is
    # dropped with it, and the grace period is short.
    if leaving:
      _READ_AHEAD.stop(os.fspath(directory))
    elif wrote:
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

  # A delete moves the step's data file to `SPARE_FILE`, where the next
  # save's snapshot is taken: it is done before that save begins. (It is
  # also a rename and an unlink in memory: nothing to wait for.)
  deletes_in_background = False

  def write_small(self, path: epath.Path, text: str) -> None:
    with open(os.fspath(path), "w", encoding="utf-8") as f:
      f.write(text)

  def fsync(self, path: epath.Path) -> None:
    del path

  def step_writer(self, step_dir: epath.Path, identity: Identity | None,
                  data_dir: str) -> StepWriter:
    return memfile.MemoryStepWriter(step_dir, identity, data_dir)

  def prefetch(self, directory: epath.Path, path: epath.Path,
               quiet_secs: float = 0.0) -> None:
    del directory, path, quiet_secs  # Its files are in memory.

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

  def close_directory(self, directory: epath.Path, *,
                      wrote: bool = False, leaving: bool = False) -> None:
    del wrote, leaving
    memfile.MAPPINGS.release(os.fspath(directory))

  def staging_arena(self, directory: epath.Path) -> memfile.SpareArena:
    return memfile.SpareArena(directory)


class _ReadAhead:
  """The threads asking the kernel to read saved data files back, one per
  checkpoint directory (its newest step's file of this process).

  A save's writes come first. Reading a step back starts only after a quiet
  spell (as long as its save took to commit) with no save beginning in its
  directory: a save that begins there drops the read not yet asked for of
  the step it makes stale, which would slow its writes. A writer that
  closes (a process exiting after its last save) has its newest step read
  back at once. Once the interpreter exits (its main thread returned, or
  `sys.exit`), nothing is read back any more: `leave`.
  """

  def __init__(self):
    self._lock = threading.Lock()
    # directory: (thread, stop: drop the rest, now: end the quiet spell)
    self._reads: dict[str, tuple[threading.Thread, threading.Event,
                                 threading.Event]] = {}
    self._left = False
    self._exit_hook = False

  def _watch_exit(self) -> None:
    """Has `leave` called when the interpreter exits, before it waits for
    threads and runs `atexit` handlers (a `close` there reads nothing);
    calls it now if the interpreter is exiting already."""
    if self._exit_hook:
      return
    self._exit_hook = True
    if not exits.before_exit(self.leave):
      self._left = True

  def leave(self) -> None:
    """The process is exiting: stops every read-back; none starts again."""
    with self._lock:
      self._left = True
      directories = list(self._reads)
    for directory in directories:
      self.stop(directory)

  def start(self, directory: str, path: str, quiet_secs: float) -> None:
    with self._lock:
      self._watch_exit()
      if self._left:
        return
    stop, now = threading.Event(), threading.Event()
    thread = threading.Thread(target=self._read,
                              args=(directory, path, quiet_secs, stop, now),
                              name="flax_ckpt_read_ahead", daemon=True)
    self.stop(directory)  # An older step's: stale now.
    with self._lock:
      if self._left:
        return
      self._reads[directory] = thread, stop, now
    try:
      thread.start()
    except RuntimeError as e:  # No thread to be had: the step stays on disk.
      with self._lock:
        if self._reads.get(directory, (None,))[0] is thread:
          del self._reads[directory]
      log.debug("not reading %s back into the page cache: %s", path, e)

  def stop(self, directory: str) -> None:
    with self._lock:
      read = self._reads.get(directory)
    if read is not None:
      _, stop, now = read
      stop.set()
      now.set()  # (Its thread then ends, having read nothing.)

  def _read(self, directory: str, path: str, quiet_secs: float,
            stop: threading.Event, now: threading.Event) -> None:
    try:
      now.wait(quiet_secs)
      handles.read_ahead(path, stopped=stop.is_set)
    except Exception as e:  # pylint: disable=broad-except
      # Deleted meanwhile, say: only a restore is slower.
      log.debug("reading %s back into the page cache: %r", path, e)
    finally:
      with self._lock:
        if self._reads.get(directory, (None,))[0] is (
            threading.current_thread()):
          del self._reads[directory]

  def finish(self, directory: str, timeout: float) -> None:
    """Reads `directory`'s newest step back now, waiting (at most `timeout`
    seconds) until it is read (or, see `handles.read_ahead`, asked for)."""
    with self._lock:
      read = self._reads.get(directory)
    if read is not None:
      thread, _, now = read
      now.set()
      thread.join(timeout)


_READ_AHEAD = _ReadAhead()


_MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")


def in_memory(path: epath.PathLike) -> bool:
  """Whether local `path` is on a file system in memory (tmpfs, ramfs)."""
  return file_system_type(path) in _MEMORY_FILE_SYSTEMS


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
