"""Reading a step's data files: byte ranges, and the host buffers they fill.

`ByteReader` reads byte ranges of the data files that a manifest names,
refusing files that are missing, short, not regular or outside the step
directory; small shards that lie side by side are read together
(`coalesced`). Every read has a deadline (`deadlines.InFlight`): one that
storage does not answer in time raises `StorageTimeoutError` naming the
file and the bytes, and its thread is left behind. `host_buffer` makes the aligned host memory that restores
read into. Needs no JAX.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from typing import (Any, Callable, ContextManager, Iterable, Iterator,
                    Protocol, Sequence)

from etils import epath
import numpy as np

from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import NOT_A_FILE
from flax_ckpt_plugin.errors import READ_FAILED

# `ByteReader.coalesced`: shards under this size are read together with
# the neighbours they touch (small shards lie side by side in a data file),
# in reads of at most `_SPAN` bytes. Where a read is a request (object
# stores), across gaps of up to `_GAP` bytes too, read and dropped.
COALESCE_BYTES = 1 << 20
_GAP = 64 << 10
_SPAN = 16 << 20


# A whole shard of at least 2 x this many bytes is read by several threads
# (`LeafReader._read_checked`), at most `READ_THREADS`, from one pool of
# the process: they only read and check, and never wait for each other.
PIECE_BYTES = 16 << 20
# The most bytes one read call asks of storage (each call has the deadline).
READ_CHUNK = 64 << 20
READ_THREADS = min(8, os.cpu_count() or 1)
# Daemon threads: a read stuck in the kernel never holds up the exit.
READ_POOL = deadlines.Pool(READ_THREADS, "flax_ckpt_plugin-read")


def on_read_threads(fn: Callable[[Any], None], items: Iterable[Any],
                    in_flight: deadlines.InFlight) -> None:
  """`fn(item)` for each item, on the read threads at once; returns once
  every call returned, then raises the first error. Not before: a call
  still running writes into its caller's buffer, which the caller may
  hand on (a pinned buffer to the next region) once this raises.

  Raises:
    StorageTimeoutError: a read of `in_flight` took longer than its
      deadline. Its thread may still write into the caller's buffer if
      the read ever returns: a restore that failed so drops its buffers.
  """
  deadlines.wait_all(
      [READ_POOL.submit(fn, item, watcher=in_flight) for item in items],
      in_flight=in_flight, pool=READ_POOL)


def host_buffer(shape: Sequence[int], dtype: np.dtype, *,
                offset: int = 0) -> np.ndarray:
  """An uninitialized C-order array starting `offset` bytes past a 64-byte
  boundary.

  The CPU backend adopts memory on such a boundary in `jax.device_put`
  without copying it, and copies any other (numpy's own allocations are
  only 16-byte aligned, so either may happen to them). Restored CPU arrays
  are not adopted (see `placement._owned_cpu_buffer` and
  `placement.place_array`); adopted ones are for numpy targets and the
  other cases.
  """
  nbytes = math.prod(shape) * dtype.itemsize
  raw = np.empty(nbytes + 128, np.uint8)
  start = -raw.ctypes.data % 64 + offset
  return raw[start:start + nbytes].view(dtype).reshape(shape)


class OpenFile(Protocol):
  """An open data file, read by offset (`backends.interface.RangedFile`
  is one)."""

  size: int

  def read_into(self, offset: int, out: memoryview) -> int:
    ...

  def mapped(self, offset: int, size: int
             ) -> ContextManager[memoryview | None]:
    ...

  def pinned_array(self, offset: int, size: int) -> Any:
    ...

  def close(self) -> None:
    ...


class Storage(Protocol):
  """What a `ByteReader` asks of a storage backend: every
  `backends.interface.Backend` has it. Named here so that reading bytes
  stands beside the storage seam, not on top of it."""

  reads_are_requests: bool

  def open_ranged(self, path: epath.Path, within: epath.Path) -> OpenFile:
    ...


class ByteReader:
  """Reads byte ranges of a step's data files; one open handle per file.

  Safe to use from several threads: each file is an `OpenFile`
  (positional reads of one descriptor on local disks, one ranged GET per
  range on object stores). Each open and read is recorded in `in_flight`
  (its deadline: `Storage(io_timeout_secs=)`), and runs on a helper thread
  where no waiter watches the calling thread (see `InFlight.call`).
  """

  def __init__(self, step_dir: epath.Path, files: dict[str, int],
               backend: Storage, within: epath.Path | None = None,
               in_flight: deadlines.InFlight | None = None):
    self._dir = step_dir
    self.in_flight = in_flight or deadlines.InFlight(where=str(step_dir))
    # No file may lead outside this folder (by default the step's).
    self._within = step_dir if within is None else within
    self._sizes = files
    self._backend = backend
    self._files: dict[str, OpenFile] = {}
    self._lock = threading.Lock()
    self._local = threading.local()  # `coalesced` spans of each thread.
    self.bytes_read = 0
    # Each read costs a request on object stores: readers of a few spread
    # ranges should rather fetch the span around them in one (see restore).
    self.prefers_few_reads = self._backend.reads_are_requests

  def _open(self, name: str) -> OpenFile:
    """The open file `name`, opened on first use. The open runs outside
    the lock (an open that storage never answers holds no other reader);
    of two threads that opened it at once, the first one's is kept."""
    with self._lock:
      f = self._files.get(name)
    if f is not None:
      return f
    f = self._open_new(name)
    with self._lock:
      kept = self._files.setdefault(name, f)
    if kept is not f:
      f.close()
    return kept

  def _open_new(self, name: str) -> OpenFile:
    path = self._dir / name
    try:
      f = self.in_flight.call(
          lambda: self._backend.open_ranged(path, within=self._within),
          f"opening data file {path}")
    except FileNotFoundError as e:
      raise CheckpointCorruptedError(
          f"data file {path} named by the manifest is missing") from e
    except OSError as e:
      if e.errno not in NOT_A_FILE:
        raise  # EACCES, EIO...: the file may be fine; do not call it bad.
      raise CheckpointCorruptedError(
          f"data file {path} named by the manifest cannot be a data file:"
          f" {e.strerror}") from e
    except CheckpointCorruptedError:
      raise  # A ValueError too, but already says what is wrong.
    except ValueError as e:  # A NUL byte in the name.
      raise CheckpointCorruptedError(
          f"data file name {name!r:.100} is not a valid file name") from e
    if f.size < self._sizes[name]:
      f.close()  # Not kept: every later open says the same.
      raise CheckpointCorruptedError(
          f"data file {path} is truncated: {f.size} bytes, manifest says"
          f" {self._sizes[name]}")
    return f

  def check_file(self, name: str) -> None:
    """Opens `name` if not yet open: raises if it is not whole.

    Called before allocating for a shard's bytes, so that a manifest's
    sizes never drive an allocation beyond what the files really hold.
    """
    self._open(name)

  def read_into(self, name: str, offset: int, out: memoryview) -> None:
    """Fills `out` with the bytes at [offset, offset + len(out)) of `name`."""
    for lo, data in getattr(self._local, "spans", {}).get(name, ()):
      if lo <= offset and offset + len(out) <= lo + len(data):
        out[:] = data[offset - lo:offset - lo + len(out)]
        return
    f = self._open(name)
    try:
      done = 0
      # One call (and deadline) per `READ_CHUNK` bytes at most.
      for lo in range(0, max(1, len(out)), READ_CHUNK):
        part = out[lo:lo + READ_CHUNK]
        got = self.in_flight.call(
            lambda: f.read_into(offset + lo, part),  # pylint: disable=cell-var-from-loop
            f"reading bytes [{offset + lo}, {offset + lo + len(part)}) of"
            f" data file {self._dir / name}")
        done += got
        if got < len(part):
          break
    except OSError as e:
      if e.errno not in READ_FAILED:
        raise
      raise OSError(e.errno, f"{e.strerror}, reading bytes [{offset},"
                    f" {offset + len(out)}) of a data file",
                    os.fspath(self._dir / name)) from e
    if done < len(out):
      raise CheckpointCorruptedError(
          f"data file {self._dir / name} ended at byte {offset + done},"
          f" expected {offset + len(out)}")
    with self._lock:
      self.bytes_read += done

  @contextlib.contextmanager
  def mapped(self, name: str, offset: int, size: int, fresh: int
             ) -> Iterator[memoryview | None]:
    """The bytes at [offset, offset + size) of `name` as a read-only view of
    the file's pages, valid inside the context; None where the storage
    maps nothing (see `backend.RangedFile.mapped`). `fresh` of them count
    as read: the others were mapped before, for the caller's last region.
    The caller's reads of the view are recorded in `in_flight` (a page
    that storage does not serve stalls the thread that touches it)."""
    f = self._open(name)
    what = (f"reading (mapped) bytes [{offset}, {offset + size}) of data"
            f" file {self._dir / name}")
    mapping = f.mapped(offset, size)
    # The mapping is populated as it is made: with the deadline, on a
    # helper thread where no waiter watches this one.
    with contextlib.ExitStack() as stack:
      view = self.in_flight.call(mapping.__enter__, what)
      stack.push(mapping)
      stack.enter_context(self.in_flight.doing(what))
      if view is not None:
        with self._lock:
          self.bytes_read += fresh
      yield view

  def pinned_array(self, name: str, offset: int, size: int) -> Any:
    """The pinned host array holding exactly [offset, offset + size) of
    `name`, where the storage has one (see
    `backends.interface.RangedFile.pinned_array`); else None. Counts
    nothing: its bytes are counted when checked through `mapped`."""
    return self._open(name).pinned_array(offset, size)

  @contextlib.contextmanager
  def coalesced(self, ranges: Iterable[tuple[str, int, int]]) -> Iterator[None]:
    """Reads the (file, offset, size) ranges in few reads, merged where near.

    Until the context exits, this thread's reads that fall inside one of
    them are served from memory: thousands of small leaves cost tens of
    reads (on object stores, requests) instead of thousands.
    """
    spans: dict[str, list[tuple[int, memoryview]]] = {}
    merged: list[list] = []
    gap = _GAP if self.prefers_few_reads else 0
    for name, lo, size in sorted(ranges):
      last = merged[-1] if merged else None
      if (last is not None and last[0] == name and lo - last[2] <= gap
          and max(last[2], lo + size) - last[1] <= _SPAN):
        last[2] = max(last[2], lo + size)
      else:
        merged.append([name, lo, lo + size])
    for name, lo, hi in merged:
      data = memoryview(np.empty(hi - lo, np.uint8))
      try:
        self.read_into(name, lo, data)
      except deadlines.StorageTimeoutError:
        raise  # Each leaf's own read would wait it out again.
      except (CheckpointCorruptedError, OSError):
        continue  # Each leaf's own read reports it, naming the leaf.
      spans.setdefault(name, []).append((lo, data))
    self._local.spans = spans
    try:
      yield
    finally:
      self._local.spans = {}

  def close(self) -> None:
    for f in self._files.values():
      f.close()
    self._files.clear()
