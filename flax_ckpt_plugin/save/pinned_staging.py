"""The pinned host memory of one manager's snapshots (`PinnedStaging`).

On an accelerator a snapshot copies each shard it writes onto its
device's pinned host memory (see `arrays.pinned`), in one batched call,
and does not wait. This is the save's side of that memory:

* How much one save may pin (`budget`).
* Getting it before the saves need it (`reserve`): pinning memory costs
  about 0.5 s per GB (measured on an H100 and an H200), once per process,
  since the runtime keeps freed pinned memory in a pool and hands it out
  again. A thread pins one buffer per piece a save copies, largest first,
  one at a time, and rests after each as long as it took
  (`RESERVE_SHARE`; the threads of every manager of the process share
  that pace), so that the train loop, which pinning holds up on an
  accelerator, runs meanwhile. A save gives the ready buffers back to the
  pool right before its copies take them.
* Each save's choice (`choose`): a piece goes onto pinned memory where
  its memory is there (in the pool, or reserved and ready); every other
  piece is copied on its device, which the save call does not wait for
  either, and the commit moves that copy to the host. While a buffer is
  being pinned, no piece goes onto pinned memory: the runtime's pinned
  allocator may be held for as long. So no save call waits for memory to
  be pinned, the first one included; what a save found not ready is
  counted in `SaveStats.unpinned_bytes`.
* The back-offs after the runtime refuses pinned memory. A save's copy
  refused: that save and the next ones copy on the devices (1, then 2, 4,
  up to `MAX_BACK_OFF` saves after refusals in a row) before one asks
  again, each logging a warning with the bytes. A buffer of the
  reservation refused: it stops, and is started again by a save after the
  same kind of back-off; the saves meanwhile take what is ready.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, NamedTuple, Sequence
import weakref

import jax
import numpy as np

from flax_ckpt_plugin.arrays import copies
from flax_ckpt_plugin.arrays import pinned
from flax_ckpt_plugin import exits
from flax_ckpt_plugin.logs import log

# After refusals in a row, the saves that copy on the devices (or that pass
# before the reservation is asked again): 1, 2, 4, ... at most this many.
MAX_BACK_OFF = 16

# The share of the time the reservations pin: after each buffer the next
# one (of any manager's reservation) waits (1 / RESERVE_SHARE - 1) times
# as long as that buffer took.
RESERVE_SHARE = 0.5

# How long `close` waits for a buffer being pinned (one piece's time).
_STOP_WAIT_SECS = 30.0


class Size(NamedTuple):
  """A piece's pinned memory, as the runtime's pool hands out freed memory:
  by size.

  Attributes:
    device: the device whose pinned host memory holds the piece.
    nbytes: the piece's bytes.
  """
  device: Any
  nbytes: int


# The process's reservations: one pins at a time, at the shared pace.
_pace = threading.Lock()
_next_at = 0.0  # Under `_pace`: when the next buffer may be pinned.
_open: "weakref.WeakSet[PinnedStaging]" = weakref.WeakSet()
_open_lock = threading.Lock()


def _stop_all() -> None:
  """At exit: every reservation pins no more buffers (none is waited for:
  the threads are daemons)."""
  with _open_lock:
    stagings = list(_open)
  for staging in stagings:
    staging._stop.set()  # pylint: disable=protected-access


def _allocate(device: Any, nbytes: int) -> jax.Array:
  """A new buffer of `nbytes` of pinned host memory on `device`, ready."""
  return pinned.pinned_buffer((nbytes,), np.dtype(np.uint8), device)


class _BackOff:
  """Refusals in a row, and the saves left to pass before asking again."""

  def __init__(self):
    self.refusals = 0
    self.left = 0

  def refused(self) -> int:
    self.refusals += 1
    self.left = min(MAX_BACK_OFF, 1 << (self.refusals - 1))
    return self.left


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
    self._lock = threading.Lock()
    # Buffers of each size that the runtime's pool holds for the saves
    # (given back by the reservation, or pinned by a save before).
    self._pooled: collections.Counter[Size] = collections.Counter()
    # The buffers a save needs, by size: the most any layout asked for.
    self._wanted: collections.Counter[Size] = collections.Counter()
    # Pinned by the reservation and held until a save gives them back.
    self._reserved: dict[Size, list[jax.Array]] = collections.defaultdict(
        list)
    self._thread: threading.Thread | None = None
    self._pinning = False  # A buffer is being pinned right now.
    self._hurry = False  # Someone waits: no rest between buffers.
    self._stop = threading.Event()
    self._done = threading.Event()  # Nothing left to reserve (for now).
    self._done.set()
    self._closed = False
    self._copies = _BackOff()  # A save's copies refused.
    self._reservation = _BackOff()  # A reserved buffer refused.
    self.reserved_bytes = 0  # Pinned by the reservation so far.

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

  # -- the reservation -------------------------------------------------------

  def reserve(self, sizes: Sequence[Size], *, wait: bool = False) -> None:
    """Has the pinned memory of a save of pieces of these sizes pinned by
    a thread (see the module's docstring), unless the pool or the
    reservation holds it already.

    Args:
      sizes: (device, bytes) of each piece a save copies onto pinned
        memory (within the budget).
      wait: block until every buffer is pinned (or refused), pinning
        without rests.
    """
    with self._lock:
      self._hurry = self._hurry or wait
      self._want(sizes)
    if wait:
      self.wait_reserved()

  def wait_reserved(self, secs: float | None = None) -> bool:
    """Blocks until the reservation has nothing left to pin (or was
    refused, or closed); returns whether it ended within `secs`."""
    return self._done.wait(secs)

  def _want(self, sizes: Sequence[Size]) -> None:
    """(Under the lock.) Raises the wanted counts to `sizes`' and starts the
    thread if something is missing (and no back-off holds it)."""
    for size, n in collections.Counter(sizes).items():
      if size.nbytes:  # Nothing to pin for an empty piece.
        self._wanted[size] = max(self._wanted[size], n)
    if (self._missing() is None or self._closed or self._stop.is_set()
        or self._reservation.left or self._thread is not None):
      return
    thread = threading.Thread(
        target=self._run, name="flax_ckpt_plugin-pinned-reserve",
        daemon=True)
    try:
      thread.start()
    except RuntimeError:  # The interpreter is exiting: pin nothing more.
      return
    self._thread = thread
    self._done.clear()
    with _open_lock:
      _open.add(self)
    exits.once_before_exit(_stop_all)

  def _missing(self) -> Size | None:
    """(Under the lock.) A size with fewer buffers pooled and reserved than
    wanted, largest first; None when none is."""
    for size in sorted(self._wanted, key=lambda s: -s.nbytes):
      if self._pooled[size] + len(self._reserved[size]) < self._wanted[size]:
        return size
    return None

  def _run(self) -> None:
    while self._take_pace():
      try:
        if not self._pin_one():
          return
      finally:
        _pace.release()
    with self._lock:  # Stopped while waiting for its turn.
      self._thread = None
      self._done.set()

  def _take_pace(self) -> bool:
    """Waits for the process's turn to pin; False once stopped."""
    while not _pace.acquire(timeout=0.1):
      if self._stop.is_set():
        return False
    return True

  def _pin_one(self) -> bool:
    """(Holding the turn.) Rests, at the pace all reservations share, then
    pins the largest buffer missing; False when the thread ends (nothing
    missing, stopped, or refused)."""
    global _next_at
    if not self._hurry:
      self._stop.wait(max(0.0, _next_at - time.monotonic()))
    with self._lock:
      size = None if self._stop.is_set() else self._missing()
      if size is None:
        self._thread = None
        self._hurry = False
        self._done.set()
        return False
      self._pinning = True
    t0 = time.monotonic()
    try:
      buf = _allocate(*size)
    except Exception as e:  # pylint: disable=broad-except
      with self._lock:
        self._pinning = False
        left = self._reservation.refused()
        self._thread = None
        self._hurry = False
        self._done.set()
      log.warning(
          "the runtime refused %d bytes of pinned host memory for the saves"
          " (%r): the saves copy what is not pinned on their devices, and"
          " pinning is tried again in %d save(s)", size.nbytes, e, left)
      return False
    now = time.monotonic()
    _next_at = now + (now - t0) * (1 / RESERVE_SHARE - 1)
    with self._lock:
      self._pinning = False
      if not self._closed:
        self._reserved[size].append(buf)
        self.reserved_bytes += size.nbytes
        self._reservation.refusals = 0
    del buf
    return True

  def close(self) -> None:
    """Stops the reservation (waiting for a buffer being pinned) and gives
    its buffers back to the runtime."""
    with self._lock:
      self._closed = True
      thread = self._thread
      self._reserved.clear()
    self._stop.set()
    if thread is not None and thread is not threading.current_thread():
      thread.join(_STOP_WAIT_SECS)
    self._done.set()
    with _open_lock:
      _open.discard(self)

  # -- each save -------------------------------------------------------------

  def choose(self, sizes: Sequence[Size]) -> list[bool] | None:
    """Which of a save's pieces (of these sizes, within the budget) go onto
    pinned memory: those whose memory the pool holds, or the reservation
    has ready (given back to the pool now, for the save's copies to take).
    The rest are copied on their devices: memory not pinned yet is never
    waited for, nor is the runtime's pinned allocator while a buffer is
    being pinned (then none goes). Asks the reservation for what is
    missing. None while backing off after a refused copy: none goes
    (each such save logged at warning)."""
    with self._lock:
      if self._reservation.left:
        self._reservation.left -= 1
      if self._copies.left:
        self._copies.left -= 1
        log.warning(
            "this save copies %d bytes on their devices (the commit moves"
            " them to the host) instead of onto pinned host memory, which"
            " the runtime refused %d time(s) in a row; %s",
            sum(size.nbytes for size in sizes), self._copies.refusals,
            f"asked again in {self._copies.left} save(s)"
            if self._copies.left else "asked again at the next save")
        self._want(sizes)
        return None
      if self._pinning:
        out = [not size.nbytes for size in sizes]
      else:
        left = collections.Counter(self._pooled)
        out = []
        for size in sizes:
          if not size.nbytes or left[size] > 0:
            left[size] -= 1
            out.append(True)
          elif self._reserved[size]:
            self._reserved[size].pop()  # Freed: back to the runtime's pool.
            self._pooled[size] += 1
            out.append(True)
          else:
            out.append(False)
      self._want(sizes)
      return out

  def copy(self, srcs: Sequence[jax.Array]) -> list[jax.Array] | None:
    """Starts a copy of each single-device array onto its device's pinned
    memory (taken from the pool: see `choose`); returns the copies, not
    awaited. None where the runtime refused (logged at warning; the next
    saves back off, see the module's docstring, and the sizes refused are
    pinned by the reservation again)."""
    try:
      out = copies.copies_onto(srcs, [
          pinned.sharding_on(next(iter(s.devices()))) for s in srcs])
    except Exception as e:  # pylint: disable=broad-except
      nbytes = sum(s.nbytes for s in srcs)
      with self._lock:
        left = self._copies.refused()
        # The pool did not have them after all.
        for s in srcs:
          size = Size(next(iter(s.devices())), s.nbytes)
          self._pooled[size] = max(0, self._pooled[size] - 1)
      log.warning(
          "the runtime refused %d bytes of pinned host memory for this save"
          " (%r): they are copied on their devices instead, and so are the"
          " pieces of the next %d save(s), before pinned memory is asked for"
          " again", nbytes, e, left)
      return None
    with self._lock:
      self._copies.refusals = 0
    return out
