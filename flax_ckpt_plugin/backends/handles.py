"""The local file system's files: a data file read by offset (`LocalFile`),
one process's files of a step (`LocalStepWriter`), `open_regular`, which
every local read of a step's files goes through (never out of the step,
never a named pipe or a device), and `read_ahead`, which has the kernel read
a file back into the page cache.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import mmap
import os
import pathlib
import stat
import sys
from typing import BinaryIO, Callable, Iterator

from etils import epath

from flax_ckpt_plugin.backends import datafile
from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.backends.interface import RangedFile
from flax_ckpt_plugin.backends.interface import StepWriter
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import ConcurrentWriterError



class LocalFile(RangedFile):
  """A local data file, read by offset (`os.preadv`) from any thread."""

  def __init__(self, fd: int, size: int):
    self._fd, self.size = fd, size

  def read_into(self, offset: int, out: memoryview) -> int:
    done = 0
    while done < len(out):
      n = os.preadv(self._fd, [out[done:]], offset + done)
      if not n:
        break
      done += n
    return done

  @contextlib.contextmanager
  def mapped(self, offset: int, size: int) -> Iterator[memoryview | None]:
    """A private, read-only mapping of the range, its pages populated at
    once (from the page cache, or read ahead from the disk); None for a
    range past the size the file had when opened."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    if size <= 0 or offset + size > self.size:
      yield None
      return
    try:
      m = mmap.mmap(self._fd, offset + size - start, prot=mmap.PROT_READ,
                    flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0),
                    offset=start)
    except (OSError, ValueError):  # A file system that maps nothing.
      yield None
      return
    view = memoryview(m)[offset - start:]
    try:
      yield view
    finally:
      try:
        view.release()
        m.close()
      except BufferError:  # Still viewed: unmapped when the views go.
        pass

  def close(self) -> None:
    os.close(self._fd)


class LocalStepWriter(StepWriter):
  """Creates files relative to the step directory's descriptor.

  The directory is opened once and checked against the identity the primary
  host recorded when it made it; if another writer replaces the directory by
  name, this process never writes into the replacement.
  """

  positional = True

  def __init__(self, step_dir: epath.Path, identity: interface.Identity | None,
               data_dir: str, *, direct_io: bool = True):
    self._fd = self._data_fd = None
    self._data_dir = data_dir
    self._direct_io = direct_io
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    self._fd = os.open(os.fspath(step_dir), flags)
    st = os.fstat(self._fd)
    if identity is not None and (st.st_dev, st.st_ino) != tuple(identity):
      self.close()
      raise ConcurrentWriterError(
          f"{step_dir} is no longer the directory this save was started in:"
          " another writer replaced it. This save is abandoned.")
    try:
      os.mkdir(data_dir, dir_fd=self._fd)
    except FileExistsError:
      pass
    self._data_fd = os.open(data_dir, flags, dir_fd=self._fd)

  def _base(self, name: str) -> str:
    head, _, base = name.partition("/")
    assert head == self._data_dir, name  # Every file lives in data_dir.
    return base

  def open(self, name: str) -> BinaryIO:
    fd = os.open(self._base(name),
                 os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644,
                 dir_fd=self._data_fd)
    return open(fd, "wb", buffering=0)

  def open_direct(self, name: str) -> int | None:
    if not (datafile.O_DIRECT and self._direct_io):
      return None
    try:
      return os.open(self._base(name),
                     os.O_WRONLY | datafile.O_DIRECT | os.O_CLOEXEC,
                     dir_fd=self._data_fd)
    except OSError as e:
      if e.errno != errno.EINVAL:
        raise
      return None  # The file system refuses direct I/O (tmpfs).

  def sync(self, f: BinaryIO) -> None:
    os.fsync(f.fileno())

  def close(self) -> None:
    for fd in (self._data_fd, self._fd):
      if fd is not None:
        os.close(fd)
    self._fd = self._data_fd = None


def open_regular(path: epath.Path, within: epath.Path, what: str,
                  where: str) -> tuple[int, int]:
  """A descriptor of regular file `path` inside `within`, and its size.

  `what` starts the messages, `where` names `within` in them.
  """
  real_dir = os.path.realpath(os.fspath(within))
  real = os.path.realpath(os.fspath(path))
  if os.path.commonpath([real_dir, real]) != real_dir:
    raise CheckpointCorruptedError(f"{what} leads outside {where}")
  # O_NONBLOCK: opening a named pipe must not wait for a writer.
  fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
  st = os.fstat(fd)
  if not stat.S_ISREG(st.st_mode):
    os.close(fd)
    raise CheckpointCorruptedError(f"{what} is not a regular file")
  return fd, st.st_size


def read_regular(path: epath.Path, within: epath.Path, limit: int) -> bytes:
  """`Backend.read_small` on a local disk: at most `limit` bytes, or raise."""
  fd, size = open_regular(path, within, str(path), os.fspath(within))
  try:
    if size > limit:
      raise CheckpointCorruptedError(
          f"{path}: {size} bytes, over the limit of {limit}")
    chunks, total = [], 0
    while total <= limit:  # It may grow meanwhile: never past limit + 1.
      chunk = os.read(fd, min(limit + 1 - total, 1 << 20))
      if not chunk:
        break
      chunks.append(chunk)
      total += len(chunk)
  finally:
    os.close(fd)
  if total > limit:
    raise CheckpointCorruptedError(f"{path}: grew over the limit of {limit}")
  return b"".join(chunks)


# What one POSIX_FADV_WILLNEED reads at most when the device's limits cannot
# be found: the kernel caps each call at the larger of the device's
# read-ahead and its largest request, and 128 KiB is the smallest default.
_READ_AHEAD_FALLBACK = 128 << 10


def _read_ahead_bytes(st_dev: int) -> int:
  """The most one POSIX_FADV_WILLNEED call reads on device `st_dev`."""
  base = f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}"
  for queue in (f"{base}/queue", f"{base}/../queue"):  # A disk; a partition.
    try:
      kib = [int(pathlib.Path(queue, name).read_text())
             for name in ("read_ahead_kb", "max_sectors_kb")]
    except (OSError, ValueError):
      continue
    return max(max(kib) << 10, _READ_AHEAD_FALLBACK)
  return _READ_AHEAD_FALLBACK


# The most of a file asked to be read back and not read yet: a save that
# begins meanwhile finds at most this much queued on the disk before its
# writes (32 MB: about 20 ms of a disk reading 1.7 GB/s). Without a bound,
# asking runs as far ahead as the device's queue holds (1.4 GB on one
# accelerator machine's disk, measured), and a save's writes wait for it.
READ_AHEAD_IN_FLIGHT_BYTES = 32 << 20

# madvise(MADV_POPULATE_READ), Linux 5.14 on: faults a mapped range in,
# reading it, and returns once it is read (Python names it from 3.13).
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ",
                         22 if sys.platform.startswith("linux") else None)


class _Libc:
  """mmap, madvise and munmap called through ctypes, which lets go of the
  interpreter's lock for the call: CPython's `mmap.madvise` keeps it while
  the kernel reads, and the train loop's thread then stood still for each
  piece's read from the disk (measured: 207 ms of 240 ms, 45-63 ms at a
  time, for a 128 MB file read back in 32 MB pieces)."""

  def __init__(self):
    libc = ctypes.CDLL(None, use_errno=True)
    # mmap64: a 64-bit file offset on 32-bit builds too (on 64-bit ones,
    # the same function).
    self.mmap = getattr(libc, "mmap64", libc.mmap)
    self.madvise, self.munmap = libc.madvise, libc.munmap
    self.mmap.restype = ctypes.c_void_p
    self.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                          ctypes.c_int, ctypes.c_int, ctypes.c_int64)
    for fn in (self.madvise, self.munmap):
      fn.restype = ctypes.c_int
    self.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    self.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)

  def populate(self, fd: int, offset: int, length: int, advice: int) -> bool:
    """Maps bytes [offset, offset + length) of file `fd` and has the kernel
    read them in (`advice`: MADV_POPULATE_READ), then unmaps them; False
    where the kernel refuses the advice (EINVAL), before anything is read.

    Raises:
      OSError: the mapping or the read failed.
    """
    addr = self.mmap(None, length, mmap.PROT_READ, mmap.MAP_PRIVATE, fd,
                     offset)
    if addr in (None, ctypes.c_void_p(-1).value):
      err = ctypes.get_errno()
      raise OSError(err, f"mapping for a read-back: {os.strerror(err)}")
    try:
      if self.madvise(addr, length, advice) == 0:
        return True
      err = ctypes.get_errno()
      if err == errno.EINVAL:
        return False
      raise OSError(err, f"reading back: {os.strerror(err)}")
    finally:
      self.munmap(addr, length)


try:
  _LIBC: _Libc | None = _Libc()
except (OSError, AttributeError):  # No C library to call (not POSIX).
  _LIBC = None


def read_ahead(path: str, stopped: Callable[[], bool] = lambda: False,
               in_flight_bytes: int = READ_AHEAD_IN_FLIGHT_BYTES) -> None:
  """Has the kernel read file `path` into the page cache, without copying it.

  The file is read in pieces of `in_flight_bytes`, each mapped and
  populated (`MADV_POPULATE_READ`), which returns once the piece is read:
  a save that begins meanwhile finds at most a piece, and the kernel's
  read-ahead past it, queued before its writes. Faulted in through a
  mapping, as by `read`, the file is cached in large folios where its
  file system takes them (ext4 from Linux 6.16, XFS), which a later
  restore maps and copies at a fraction of the cost of single pages; the
  kernel reads POSIX_FADV_WILLNEED's pages one by one, and a first restore
  of the benchmark's 0.98 GB state took 0.47-0.68 s after it against
  0.24-0.25 s (docs/performance.md). Where a mapping cannot be populated
  (older kernels), the pieces are asked for with POSIX_FADV_WILLNEED
  (`_ask_ahead`). Returns once the whole file is read (or asked for), or
  at the first piece after `stopped()` turns true. The interpreter's lock
  is free while the kernel reads (`_Libc`): the train loop's thread runs.
  """
  fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
  try:
    size = os.fstat(fd).st_size
    piece = max(mmap.ALLOCATIONGRANULARITY, in_flight_bytes
                - in_flight_bytes % mmap.ALLOCATIONGRANULARITY)
    offset = 0
    while offset < size and _POPULATE_READ is not None and _LIBC is not None:
      if stopped():
        return
      length = min(piece, size - offset)
      if not _LIBC.populate(fd, offset, length, _POPULATE_READ):
        break  # A kernel without it: asked for instead, from this piece on.
      offset += length
    if offset < size:
      _ask_ahead(fd, offset, size, stopped, in_flight_bytes)
  finally:
    os.close(fd)


def _ask_ahead(fd: int, start: int, size: int, stopped: Callable[[], bool],
               in_flight_bytes: int) -> None:
  """Asks the kernel to read bytes [start, size) of file `fd`.

  Each POSIX_FADV_WILLNEED only starts reads, and the kernel caps the bytes
  one call reads (to the device's read-ahead or largest request), so the
  file is asked for in pieces of that size. At most `in_flight_bytes` (and
  at least 4 pieces) are asked for and not read yet: before asking for
  more, this waits for the oldest piece by reading one byte of its end,
  which waits for the kernel's read rather than starting another.
  """
  if not hasattr(os, "posix_fadvise"):  # (macOS has none.)
    return
  piece = _read_ahead_bytes(os.fstat(fd).st_dev)
  depth = max(4, in_flight_bytes // piece)
  asked = collections.deque()  # The last byte of each piece not waited for.
  for offset in range(start, size, piece):
    if stopped():
      return
    if len(asked) >= depth:
      os.pread(fd, 1, asked.popleft())
    os.posix_fadvise(fd, offset, piece, os.POSIX_FADV_WILLNEED)
    asked.append(min(offset + piece, size) - 1)
