"""The pinned host memory of one manager's snapshots (`PinnedStaging`).

On an accelerator a snapshot copies each shard it writes onto its
device's pinned host memory (see `arrays.pinned`), in one batched call,
and does not wait. This is the save's side of that memory: how much one
save may pin (`budget`), taking it before the first save (`reserve`), and
the back-off after the runtime refuses it: the saves after a refusal take
the plain transfers (1, then 2, 4, up to `MAX_BACK_OFF` saves after
refusals in a row) before one asks again, each logging a warning with
the bytes asked for.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from flax_ckpt_plugin.arrays import copies
from flax_ckpt_plugin.arrays.pinned import sharding_on
from flax_ckpt_plugin.arrays.pinned import wait_ready
from flax_ckpt_plugin.logs import log

# After refusals in a row, the saves that take the plain transfers before
# one asks for pinned memory again: 1, 2, 4, ... at most this many.
MAX_BACK_OFF = 16


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
    self._warmed: set[Any] = set()  # What `reserve` took.
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
      out = copies.copies_onto(srcs, [sharding_on(next(iter(s.devices())))
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

  def reserve(self, pieces: Sequence[jax.Array]) -> None:
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
      wait_ready(copies.copies_onto(pieces, [sharding_on(next(iter(p.devices())))
                                      for p in pieces]),
                 f"warming up {nbytes} bytes of pinned host memory")
    except Exception as e:  # pylint: disable=broad-except
      log.warning("the runtime refused %d bytes of pinned host memory for"
                  " the warm-up (%r): the first save asks for them again",
                  nbytes, e)
