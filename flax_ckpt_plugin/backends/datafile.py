"""One process's data file: written by offset on a local disk, front to
back on an object store.

Large shards go to the disk with direct I/O; see `DataFile`. The save's
writer (`save.writer`) decides what goes into the file and records where.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import numpy as np

from flax_ckpt_plugin import deadlines

CHUNK = 64 << 20  # Bytes per write call; one call may write less than asked.

# Direct writes of one process in flight at once, `CHUNK` bytes each: one
# at a time leaves a disk's queue idle between them (measured on this VM's
# virtio disk: 1.41-1.56 GB/s from one thread, 1.61-1.70 GB/s from 2 to
# 8; an NVMe drive gains more).
WRITE_THREADS = 4
# Daemon threads: a write stuck in the kernel never holds up the exit.
_WRITERS = deadlines.Pool(WRITE_THREADS, "flax_ckpt_plugin-write")

# Direct I/O (O_DIRECT) moves data from the snapshot to the disk without
# copying it into the page cache first: on a 2-core machine that copy is
# CPU time taken from the train step, and skipping it also makes the write
# itself faster. The kernel requires the memory address, the file offset
# and the length of each direct write to be multiples of the block size.
# Host buffers are not aligned, so each large shard is instead placed in the
# file at an offset congruent to its memory address modulo `ALIGN` (the
# gap before it, under `ALIGN` bytes, is left as a hole). Its aligned
# middle then goes out with direct writes straight from the snapshot, and
# only its ragged head and tail (under `ALIGN` bytes each) through the page
# cache. Readers follow the offsets in the shard table, as for any layout.
ALIGN = 4096
DIRECT_MIN_BYTES = 1 << 20  # Smaller shards go through the page cache.
O_DIRECT = getattr(os, "O_DIRECT", 0)


def write_all(f: Any, buf: memoryview) -> None:
  """Writes all of `buf` to the stream `f`: an unbuffered write may write
  less than asked."""
  while buf:
    n = f.write(buf[:CHUNK])
    if not n:  # None: a non-blocking stream; 0: nothing went (not expected).
      raise OSError(errno.EIO, f"write of {len(buf)} bytes wrote {n!r}")
    buf = buf[n:]


class DataFile:
  """One process's data file: every buffer is placed (`place`), then
  written (`write`).

  On a local disk (`StepWriter.positional`) it is written by offset, and
  large shards go out with direct I/O where the file system takes it; a
  file system that refuses it (tmpfs, some FUSE mounts) gets every byte
  through the page cache instead, with no error. On an object store it is
  a stream: the buffers are written in the order they were placed.

  Every write, sync and close is recorded in `in_flight`, with its
  deadline: whoever waits for the writing thread (the commit's waiters)
  raises `StorageTimeoutError` naming the file and the bytes when one
  does not return in time. `shown` names the file in messages.
  """

  def __init__(self, out: Any, name: str,
               in_flight: deadlines.InFlight | None = None,
               shown: str | None = None):
    self._out = out
    self._io = in_flight or deadlines.InFlight()
    self._shown = shown or name
    with self._io.doing(f"opening {self._shown}"):
      self.f = out.open(name)
      self._positional = out.positional
      self._direct = (out.open_direct(name) if O_DIRECT and self._positional
                      else None)
    self._direct_ok = self._direct is not None  # Writes are taken.
    self._pending: list[futures.Future] = []  # Direct writes started.
    self._view: memoryview | None | bool = False  # False: not asked yet.
    self.end = 0
    self._streamed = 0  # A stream's bytes written so far.

  @property
  def direct(self) -> bool:
    return self._direct_ok

  def place(self, nbytes: int, address: int | None) -> int:
    """The file offset for a buffer of `nbytes` at memory `address` (None:
    unknown), after everything placed so far."""
    offset = self.end
    if self.direct and nbytes >= DIRECT_MIN_BYTES and address is not None:
      offset += (address - offset) % ALIGN
    self.end = offset + nbytes
    return offset

  def write(self, buf: np.ndarray, offset: int) -> None:
    """Writes `buf` (uint8, one dimension) at `offset`, from `place`;
    every buffer is placed before the first is written. Where `buf` is not
    where `place` was told, it goes through the page cache. A stream takes
    the buffers in the order they were placed."""
    what = (f"writing bytes [{offset}, {offset + buf.nbytes}) of"
            f" {self._shown}")
    if not self._positional:
      if offset != self._streamed:
        raise ValueError(f"a stream is written front to back: offset"
                         f" {offset}, {self._streamed} bytes written")
      view = memoryview(buf)
      for pos in range(0, len(view), CHUNK):  # A deadline per chunk.
        with self._io.doing(f"writing bytes [{offset + pos},"
                            f" {offset + min(len(view), pos + CHUNK)}) of"
                            f" {self._shown}"):
          write_all(self.f, view[pos:pos + CHUNK])
      self._streamed += buf.nbytes
      return
    if not self.direct and self._mapped() is not None:
      dst = np.frombuffer(self._view, np.uint8, buf.nbytes, offset)
      if buf.nbytes and dst.ctypes.data == buf.ctypes.data:
        return  # The snapshot was taken into these pages (`memfile`).
      for pos in range(0, buf.nbytes, CHUNK):  # A deadline per chunk.
        with self._io.doing(f"writing bytes [{offset + pos},"
                            f" {offset + min(buf.nbytes, pos + CHUNK)}) of"
                            f" {self._shown}"):
          # Into the file's pages; numpy releases the GIL.
          np.copyto(dst[pos:pos + CHUNK], buf[pos:pos + CHUNK])
      return
    view = memoryview(buf)
    head = tail = len(view)
    if (self.direct and buf.nbytes >= DIRECT_MIN_BYTES
        and (buf.ctypes.data - offset) % ALIGN == 0):
      head = -buf.ctypes.data % ALIGN
      tail = head + (len(view) - head) // ALIGN * ALIGN
    with self._io.doing(what):
      pwrite_all(self.f.fileno(), view[:head], offset)
    # The aligned middle in chunks, several at once (see `WRITE_THREADS`);
    # `sync` waits for them.
    for pos in range(head, tail, CHUNK):
      end = min(tail, pos + CHUNK)
      self._pending.append(_WRITERS.submit(
          self._write_direct, view[pos:end], offset + pos,
          watcher=self._io))
    with self._io.doing(what):
      pwrite_all(self.f.fileno(), view[tail:], offset + tail)

  def _write_direct(self, view: memoryview, offset: int) -> None:
    """Writes `view` (aligned, at an aligned offset) with direct I/O, what
    the file system refuses of it through the page cache."""
    with self._io.doing(f"writing bytes [{offset}, {offset + len(view)}) of"
                        f" {self._shown}"):
      self._write_direct_unrecorded(view, offset)

  def _write_direct_unrecorded(self, view: memoryview, offset: int) -> None:
    pos = 0
    while pos < len(view) and self._direct_ok:
      try:
        written = os.pwrite(self._direct, view[pos:], offset + pos)
      except OSError as e:
        if e.errno != errno.EINVAL:
          raise
        # The file system took the O_DIRECT open but not the write.
        self._direct_ok = False
        break
      if not written:
        raise OSError(errno.EIO, "direct write wrote nothing")
      pos += written - written % ALIGN  # Stay aligned after a short write.
    pwrite_all(self.f.fileno(), view[pos:], offset + pos)

  def _drain(self) -> None:
    """Waits for every write started; raises the first one's error, or
    `StorageTimeoutError` for one that took longer than its deadline."""
    pending, self._pending = self._pending, []
    deadlines.wait_all(pending, in_flight=self._io, pool=_WRITERS)

  def sync(self) -> None:
    self._drain()
    with self._io.doing(f"syncing {self._shown}"):
      self._out.sync(self.f)

  def _mapped(self) -> memoryview | None:
    if self._view is False:
      self._view = self._out.mapping(self.f, self.end)
    return self._view

  def _close_direct(self) -> None:
    if self._direct is not None:
      os.close(self._direct)
      self._direct = None

  def close(self) -> None:
    """Closes the file, cut to what was placed (it may reuse a longer one),
    once the writes started have ended (their errors were `sync`'s to
    raise)."""
    try:
      self._drain()
    except BaseException:  # pylint: disable=broad-except
      pass
    if self._io.given_up:
      # Writes left behind by their deadline may still use the
      # descriptors: closed, their numbers could go to another file.
      return
    self._close_direct()
    if self._view:
      self._view.release()
    self._view = None
    with self._io.doing(f"closing {self._shown}"):
      if not self._positional:
        self.f.close()  # (An object store uploads its last part here.)
        return
      try:
        if os.fstat(self.f.fileno()).st_size > self.end:
          os.ftruncate(self.f.fileno(), self.end)
      finally:
        self.f.close()


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
  while view:
    n = os.pwrite(fd, view[:CHUNK], offset)
    if not n:
      raise OSError(errno.EIO, "write wrote nothing")
    view, offset = view[n:], offset + n
