"""Pinned host memory: how accelerator shards travel to and from the host.

A copy between an accelerator and host memory that the runtime has pinned
(page-locked) runs at the link's speed, and its call returns at once.
Measured on an NVIDIA H100 with 3.2 GB of state: device to pinned host 52
GB/s, the call 0.3-0.5 ms, against 1.8 GB/s into pageable memory (which
`np.asarray` waits for); host to device 50 GB/s from pinned memory, 7.7 GB/s
from a numpy array. So:

* A snapshot copies each shard it writes from an accelerator onto its
  device's `pinned_host` memory, all in one batched call (`PinnedStaging.
  copy`), and does not wait: the writer waits for each shard just before it
  checksums and writes it, reading the pinned buffer through a zero-copy
  view (`snapshot.ShardData.host`). A step that donates the state right
  after the call does not tear the copy: the runtime orders the donation
  after the transfer (checked bit for bit on the H100).
* A restore reads file bytes into pinned buffers and moves them to the
  device from there (`RestoreWindow`), the next reads overlapping the
  transfers; a buffer is read into again for the next region of its shape.

Pinned memory is slow to get, scarce, and on TPU reported never to be given
back, so it is used with care:

* Every pinned buffer comes from the runtime's pool, which keeps what is
  freed and hands it out again: on the H100 the first 3.2 GB copy's call
  took 1.6 s (the memory is pinned then, about 0.5 s per GB), later ones
  0.4 ms, with RSS flat. A snapshot's buffers go back to the pool when its
  commit ends, and the next save waits for that commit anyway.
* `PinnedStaging.warm_up` takes as much pinned memory as the next save
  will use and gives it back to the pool, so that the first save blocks no
  longer than later ones. It blocks: pinning holds up the process's other
  device work anyway (measured on the H100: train steps took 50 times
  longer while 3.2 GB were pinned on a background thread), so the callback
  does it where the loop has not started, in `restore_or_initialize` (or
  at its first call). The cost: about 0.5 s per GB then, and that much
  host memory pinned by the runtime for the life of the process.
* A save pins at most `budget` bytes (default: all it writes); shards past
  it take the plain transfer, which the save call waits for.
* When the runtime cannot give pinned memory (a copy raises), that save
  takes the plain transfers, and so do the next few (1, then 2, 4, up to
  `MAX_BACK_OFF` saves after refusals in a row) before a save asks again:
  memory that was short at one moment (another allocation, a restore's
  window) is often there later. Each such save logs a warning with the
  bytes asked for and counts them in `SaveStats.pinned_fallback_bytes`. A
  restore whose window is refused reads the rest of its leaves the plain
  way; it changes nothing for the saves.
* Every wait here has a deadline (`wait_ready` for the runtime's
  transfers, `FILL_WAIT_SECS` for room in a restore's window) that ends in
  an error naming what was waited for, never a hang.

The CPU backend has a `pinned_host` memory kind too. CPU devices take this
path only when the environment sets `FLAX_CKPT_PLUGIN_PINNED_CPU=1`: the
test suite's switch, so that the accelerator path runs on any machine.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.multihost.deadlines import DEADLINES
from flax_ckpt_plugin.multihost.deadlines import NoAnswer
from flax_ckpt_plugin.save.copies import bits_dtype
from flax_ckpt_plugin.save.copies import copies_onto
from flax_ckpt_plugin.save.copies import writable_view

PINNED = "pinned_host"
CPU_SWITCH = "FLAX_CKPT_PLUGIN_PINNED_CPU"

# The longest a copy between a device and host memory is waited for (here
# and by the writer, `snapshot.ShardData.host`). Far longer than any copy
# takes (a 13 GB state crosses the slowest path, pageable host memory at
# 1.8 GB/s, in 7 s): a wait this long is a runtime that hangs, and the
# waiting thread gets an error instead of hanging too.
TRANSFER_WAIT_SECS = 300.0

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

# After refusals in a row, the saves that take the plain transfers before
# one asks for pinned memory again: 1, 2, 4, ... at most this many.
MAX_BACK_OFF = 16


def _cpu_switch() -> bool:
  return os.environ.get(CPU_SWITCH) == "1"


@functools.lru_cache(maxsize=None)
def _has_pinned(device: Any) -> bool:
  try:
    return any(m.kind == PINNED for m in device.addressable_memories())
  except Exception:  # pylint: disable=broad-except
    return False  # A runtime without memory kinds.


def takes(device: Any) -> bool:
  """Whether shards on `device` travel through pinned host memory (where
  the runtime gives it: see `PinnedStaging.copy`, `RestoreWindow.take`)."""
  if device.platform == "cpu" and not _cpu_switch():
    return False
  return _has_pinned(device)


def fits(dtype: Any) -> bool:
  """Whether values of `dtype` can be read through a view of their buffer.

  Sub-byte types (int4, float4) are packed on the device: they take the
  plain transfer, which unpacks them.
  """
  return (bits_dtype(dtype) is not None
          or np.issubdtype(np.dtype(dtype), np.complexfloating))


def wait_ready(arrays: list[Any], what: str | Callable[[], str],
               secs: float | None = None) -> None:
  """Waits until every array is ready (its copy or program done), raising
  the runtime's error of one that failed.

  Arrays already ready cost a look each (0.2 us); a wait is made on a
  helper thread (`deadlines`), abandoned after `secs` (default
  `TRANSFER_WAIT_SECS`).

  Args:
    arrays: jax arrays (or objects with `block_until_ready`).
    what: what they are, for the error (or a callable that says it, so
      that a wait that ends at once formats nothing).
    secs: the deadline.

  Raises:
    TimeoutError: not ready after `secs`; names `what` was waited for.
  """
  pending = [a for a in arrays
             if not getattr(a, "is_ready", lambda: False)()]
  if pending:
    secs = TRANSFER_WAIT_SECS if secs is None else secs
    try:
      DEADLINES.call(lambda: [a.block_until_ready() for a in pending], secs)
    except NoAnswer:
      raise TimeoutError(
          f"{what if isinstance(what, str) else what()}: {len(pending)}"
          f" array(s) not ready after {secs:g} s; the runtime's copies do"
          " not finish") from None
  for a in arrays:  # Ready ones return at once; a failed one raises.
    a.block_until_ready()


@functools.lru_cache(maxsize=None)
def sharding_on(device: Any, kind: str = PINNED) -> jax.sharding.Sharding:
  return jax.sharding.SingleDeviceSharding(device, memory_kind=kind)


def pinned_buffer(shape: tuple[int, ...], dtype: np.dtype, device: Any
                  ) -> jax.Array:
  """A new buffer of pinned host memory on `device`, ready to be written
  (its contents undefined); raises where the runtime refuses it."""
  buf = jax.device_put(np.empty(shape, dtype), sharding_on(device))
  wait_ready([buf], f"a pinned buffer of {buf.nbytes} bytes on {device}")
  return buf


class PinnedStaging:
  """The pinned host memory of one manager's snapshots.

  Args:
    budget: the most bytes one save copies into pinned memory (None: all
      that this process writes; 0: none).
  """

  def __init__(self, budget: int | None = None):
    if budget is not None and budget < 0:
      raise ValueError(f"pinned host budget must be >= 0, got {budget}")
    self.budget = budget
    self._warmed: set[Any] = set()  # What `warm_up` took.
    self._refusals = 0  # Refusals in a row.
    self._back_off = 0  # Saves left that take the plain transfers.

  def split(self, nbytes: Sequence[int]) -> int:
    """How many of the shards (in order, of these sizes) fit the budget."""
    if self.budget is None:
      return len(nbytes)
    total = 0
    for i, n in enumerate(nbytes):
      total += n
      if total > self.budget:
        return i
    return len(nbytes)

  def copy(self, srcs: Sequence[jax.Array]) -> list[jax.Array] | None:
    """Starts a copy of each single-device array onto its device's pinned
    memory; returns the copies, not awaited. None where this save takes
    the plain transfers instead: the runtime refused (then the next saves
    do too, backing off; see the module's docstring), or an earlier
    refusal's back-off is not over. Each None is logged at warning."""
    nbytes = sum(s.nbytes for s in srcs)
    if self._back_off:
      self._back_off -= 1
      log.warning(
          "this save copies %d bytes through pageable memory (the save call"
          " waits for it) instead of pinned host memory, which the runtime"
          " refused %d time(s) in a row; %s", nbytes, self._refusals,
          f"asked again in {self._back_off} save(s)" if self._back_off
          else "asked again at the next save")
      return None
    try:
      out = copies_onto(srcs, [sharding_on(next(iter(s.devices())))
                               for s in srcs])
    except Exception as e:  # pylint: disable=broad-except
      self._refused(e, nbytes)
      return None
    self._refusals = 0
    return out

  def _refused(self, error: BaseException, nbytes: int) -> None:
    self._refusals += 1
    self._back_off = min(MAX_BACK_OFF, 1 << (self._refusals - 1))
    log.warning(
        "the runtime refused %d bytes of pinned host memory (%r): this save"
        " copies them through pageable memory, which the save call waits"
        " for, and so do the next %d save(s) before pinned memory is asked"
        " for again", nbytes, error, self._back_off)

  def warm_up(self, pieces: Sequence[jax.Array]) -> None:
    """Copies these pieces of a state onto pinned memory, waits, and gives
    the memory back to the runtime's pool, so that the saves after take it
    from there; once per set of shapes. Blocks: pinning memory holds up the
    process's other device work anyway (measured on an H100: train steps
    stalled while 3.2 GB were pinned in the background), so it is done at
    a moment of the caller's choosing, before the first save.

    Args:
      pieces: the arrays a save would copy (within the budget).
    """
    key = tuple(sorted((str(next(iter(p.devices()))), p.nbytes)
                       for p in pieces))
    if not pieces or key in self._warmed:
      return
    self._warmed.add(key)
    if self._back_off:
      return  # The runtime refused lately: a save asks again in its turn.
    nbytes = sum(p.nbytes for p in pieces)
    try:
      wait_ready(copies_onto(pieces, [sharding_on(next(iter(p.devices())))
                                      for p in pieces]),
                 f"warming up {nbytes} bytes of pinned host memory")
    except Exception as e:  # pylint: disable=broad-except
      log.warning("the runtime refused %d bytes of pinned host memory for"
                  " the warm-up (%r): the first save asks for them again",
                  nbytes, e)


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
      out = copies_onto([buf] * len(shardings), shardings)
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
