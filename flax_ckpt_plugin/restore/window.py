"""The restore window: pinned host buffers that a restore reads file bytes
into and sends to devices from (`RestoreWindow`), the next reads
overlapping the transfers; see `arrays.pinned` for why pinned memory.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from flax_ckpt_plugin.arrays import copies
from flax_ckpt_plugin.arrays.copies import writable_view
from flax_ckpt_plugin.arrays.pinned import pinned_buffer
from flax_ckpt_plugin.arrays.pinned import wait_ready
from flax_ckpt_plugin.logs import log

# A restore pins at most this many bytes of buffers (a larger region takes
# one alone): the link moves a buffer in a fraction of the time its bytes
# take to read, so two in turn keep it busy (each read by several threads,
# see `reader`); little enough to pin once, at about 0.5 s per GB.
RESTORE_WINDOW_BYTES = 512 << 20

# The longest a restore thread waits for room in the window while other
# threads fill their buffers and none is sent or given back (each a read of
# one region from storage: a region larger than the window is read alone,
# 10 GB from a bucket at 30 MB/s in under 6 minutes). Past it the restore
# fails, naming the wait: a thread that never hands its buffer on.
FILL_WAIT_SECS = 600.0


class RestoreWindow:
  """Pinned buffers that a restore reads file bytes into, and their
  transfers to devices: at most `limit` bytes of them at a time (a larger
  buffer alone), so a restore pins that much once, from the runtime's pool.

  A buffer whose transfers are done is kept for the next region of its
  shape (a model's layers share a few shapes): it is read into again, with
  no allocation and no copy to make it. Used by the restore threads
  together; `take` waits for the oldest transfers, or for another thread
  to send its buffer or give it back, once the window is full. Every
  buffer taken is either sent or given back (`give_back`: its read
  failed), so that a failed read never leaves its bytes counted.

  Where the runtime refuses a buffer, `take` returns None from then on:
  the rest of this restore reads its leaves the plain way (logged once).
  """

  def __init__(self, limit: int | None = None):
    self._limit = RESTORE_WINDOW_BYTES if limit is None else limit
    self._cond = threading.Condition()
    # (bytes, buffer, its transfers), oldest first.
    self._in_flight: collections.deque[tuple[int, Any, list[Any]]] = (
        collections.deque())
    self._free: dict[Any, list[Any]] = collections.defaultdict(list)
    self._bytes = 0  # Taken, in flight or free.
    self._plain = False  # The runtime refused a buffer.
    self._moves = 0  # Sends and give-backs so far (the waits' progress).

  def take(self, shape: tuple[int, ...], dtype: np.dtype, device: Any
           ) -> tuple[jax.Array, np.ndarray] | None:
    """A pinned buffer on `device`'s host memory and a writable view of it,
    counted in the window until it is sent and its transfers are done, or
    given back; None if the runtime refused one (this time or before).

    Raises:
      TimeoutError: no room in the window within `FILL_WAIT_SECS`, or the
        transfers it waited for not done within `wait_ready`'s.
    """
    if self._plain:
      return None
    dtype = np.dtype(dtype)
    key = (tuple(shape), dtype, device)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = self._reserve(key, nbytes)
    if buf is None:
      try:
        buf = pinned_buffer(shape, dtype, device)
      except Exception as e:  # pylint: disable=broad-except
        self._release(nbytes)
        if not self._plain:
          self._plain = True
          log.warning("the runtime refused a pinned buffer of %d bytes for"
                      " a restore (%r): the rest of this restore reads its"
                      " leaves the plain way", nbytes, e)
        return None
    return buf, writable_view(buf)

  def give_back(self, buf: jax.Array) -> None:
    """Returns a buffer from `take` that will not be sent (its read
    failed): it stays counted, free for the next region of its shape or
    dropped to make room."""
    with self._cond:
      self._free[_key_of(buf)].append(buf)
      self._moves += 1
      self._cond.notify_all()

  def send(self, buf: jax.Array, shardings: Sequence[jax.sharding.Sharding]
           ) -> list[jax.Array]:
    """Starts the transfer of a buffer from `take`, once filled, onto each
    of `shardings`; the buffer is taken again once they are done."""
    try:
      out = copies.copies_onto([buf] * len(shardings), shardings)
    except BaseException:
      self._release(buf.nbytes)
      raise
    with self._cond:
      self._in_flight.append((buf.nbytes, buf, out))
      self._moves += 1
      self._cond.notify_all()
    return out

  def wait(self) -> None:
    """Waits for every transfer sent and frees every buffer; raises the
    first transfer's error (TimeoutError: not done within
    `wait_ready`'s deadline)."""
    with self._cond:
      sent, self._in_flight = list(self._in_flight), collections.deque()
      self._free.clear()
      self._bytes = 0
    wait_ready([a for *_, arrays in sent for a in arrays],
               f"a restore's transfers of {sum(n for n, *_ in sent)} bytes"
               " out of pinned host memory")

  def _release(self, nbytes: int) -> None:
    with self._cond:
      self._bytes -= nbytes
      self._moves += 1
      self._cond.notify_all()

  def _reserve(self, key: Any, nbytes: int) -> jax.Array | None:
    """Makes room for `nbytes` and counts them; returns a free buffer of
    `key`'s shape if there is one (else the caller makes one)."""
    deadline = time.monotonic() + FILL_WAIT_SECS
    with self._cond:
      moves = self._moves
      while True:
        if self._moves != moves:  # Others moved on: a new deadline.
          moves, deadline = self._moves, time.monotonic() + FILL_WAIT_SECS
        if self._free.get(key):
          return self._free[key].pop()  # Counted already.
        if not self._bytes or self._bytes + nbytes <= self._limit:
          self._bytes += nbytes
          return None
        if self._in_flight:
          size, buf, arrays = self._in_flight.popleft()
          self._cond.release()
          try:  # Their source is then free.
            wait_ready(arrays, f"the transfers of a {size}-byte pinned"
                       " buffer of a restore")
          except TimeoutError:
            raise  # (The window is the restore's: it is dropped with it.)
          except Exception:  # pylint: disable=broad-except
            buf = None  # Raised where the restore waits for every transfer.
          finally:
            self._cond.acquire()
          if buf is not None:
            self._free[_key_of(buf)].append(buf)
          else:
            self._bytes -= size
        elif any(self._free.values()):  # Free, but of other shapes.
          for bufs in self._free.values():
            if bufs:
              self._bytes -= bufs.pop().nbytes
              break
        else:  # Other threads fill theirs: wait for a send or a give-back.
          left = deadline - time.monotonic()
          if left > 0:
            self._cond.wait(left)
          else:
            raise TimeoutError(
                f"a restore waited {FILL_WAIT_SECS:g} s for room for a"
                f" pinned buffer of {nbytes} bytes: {self._bytes} of the"
                f" window's {self._limit} bytes are held by buffers being"
                " filled, and none was sent or given back meanwhile")


def _key_of(buf: jax.Array) -> Any:
  return (tuple(buf.shape), np.dtype(buf.dtype), next(iter(buf.devices())))
