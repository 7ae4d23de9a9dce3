"""When a callback saves; and when `every_secs` has passed, decided alike on
every process, rarely talking (`every_steps="auto"` is `interval`'s).

Hosts' clocks disagree, so one process (the primary host) decides and the
others must hear its decision before they leave the step. Asking it at every
step would cost every other process a blocking round trip to the
coordination service per step. Instead, each answer that is "not yet" also
names the next step at which to ask again: half the remaining time at the
primary's current step rate. Until that step no process asks, so a job asks
about log2(every_secs / step time) times per interval instead of once per
step. Steps that speed up by more than 2x between two asks can make a save
come a few steps late; never early, and never on some processes only.
"""

from __future__ import annotations

import math
import operator
import time
from typing import Callable, Iterable

from flax_ckpt_plugin.loop import interval
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib

# `every_steps="auto"`: see `interval`.
AUTO = "auto"


def monotonic() -> float:
  """The clock of `every_secs`: `time.monotonic` (a test may replace this
  function before it makes a callback)."""
  return time.monotonic()


class Triggers:
  """When a callback saves, decided alike on every process: to the
  persistent tier at every positive multiple of `every_steps` (or, with
  `every_steps="auto"`, at the interval `interval.AutoEverySteps` works
  out from `mtbf_secs` and the measured costs, within `min_every_steps` and
  `max_every_steps`), when `every_secs` have passed (`EverySecs`, from
  `start`), at `on_steps` and at `last_step`; to the local tier at every
  positive multiple of `local_every_steps`.

  Raises:
    ValueError: an interval that cannot be kept; `every_steps="auto"`
      without `mtbf_secs`, or its options without it.
  """

  def __init__(self, *, every_steps: int | str | None,
               every_secs: float | None,
               on_steps: Iterable[int], last_step: int | None,
               local_every_steps: int | None,
               mtbf_secs: float | None = None,
               min_every_steps: int | None = None,
               max_every_steps: int | None = None,
               clock: Callable[[], float] | None = None):
    auto = every_steps == AUTO
    if auto and mtbf_secs is None:
      raise ValueError(
          'every_steps="auto" saves at the interval that loses least'
          " time to saves and failures, which needs the job's mean time"
          " between failures: pass tolerance=FaultTolerance(mtbf_secs=...)")
    if not auto:
      given = [f"{name}={value!r}" for name, value in (
          ("mtbf_secs", mtbf_secs), ("min_every_steps", min_every_steps),
          ("max_every_steps", max_every_steps)) if value is not None]
      if given:
        raise ValueError(
            f"FaultTolerance({', '.join(given)}) sets how every_steps="
            f'"auto" chooses its interval, but every_steps is'
            f" {every_steps!r}: pass every_steps=\"auto\" or drop them")
      if every_steps is not None and (isinstance(every_steps, str)
                                      or every_steps < 1):
        raise ValueError(
            f'every_steps must be an int >= 1 or "auto", got {every_steps!r}')
    if every_secs is not None and not every_secs > 0:
      raise ValueError(f"every_secs must be > 0, got {every_secs}")
    self.every_steps, self.every_secs = every_steps, every_secs
    self.on_steps = frozenset(operator.index(s) for s in on_steps)
    self.last_step, self.local_every_steps = last_step, local_every_steps
    self._clock = clock or monotonic
    self.timer: EverySecs | None = None
    self._auto_options = (mtbf_secs, interval.Bounds(
        min_every_steps, max_every_steps)) if auto else None
    self.auto: interval.AutoEverySteps | None = None

  def start(self, coord: coordinator_lib.Coordinator, *, is_primary: bool,
            timeout_ms: int) -> None:
    """Starts the `every_secs` clock, decided by the primary of `coord`,
    and the `every_steps="auto"` schedule, whose intervals it decides."""
    if self.every_secs is not None:
      self.timer = EverySecs(self.every_secs, self._clock, coord,
                             is_primary=is_primary, timeout_ms=timeout_ms)
    if self._auto_options is not None:
      mtbf_secs, bounds = self._auto_options
      self.auto = interval.AutoEverySteps(
          mtbf_secs=mtbf_secs, bounds=bounds, coord=coord,
          is_primary=is_primary, timeout_ms=timeout_ms)

  def persistent(self, step: int, name: str) -> bool:
    """Whether `step` is due in the persistent tier (`name`: the manager's,
    for the `every_secs` keys)."""
    due = self.timer is not None and self.timer.due(step, name)
    if self.auto is not None:
      due |= self.auto.due(step)
    elif self.every_steps is not None and step > 0:
      due |= step % self.every_steps == 0
    return due or step in self.on_steps or step == self.last_step

  # The measures of `every_steps="auto"` (see `interval.Costs`), taken by
  # the callback in the loop's thread; nothing without it.

  def call_started(self) -> None:
    if self.auto is not None:
      self.auto.costs.call_started(self._clock())

  def call_ended(self, *, committing: bool, busy: bool) -> None:
    if self.auto is not None:
      self.auto.costs.call_ended(self._clock(), committing=committing,
                                 busy=busy)

  def save_started(self) -> None:
    """A persistent save starts (its previous commit may still run)."""
    if self.auto is not None:
      self.auto.costs.save_started(self._clock())

  def saving(self, step: int, name: str) -> dict[str, float]:
    """The persistent tier saves `step`, its previous commit finished: see
    `AutoEverySteps.saving`."""
    return {} if self.auto is None else self.auto.saving(step, name)

  def save_ended(self) -> None:
    if self.auto is not None:
      self.auto.costs.save_ended(self._clock())

  def local(self, step: int) -> bool:
    return (self.local_every_steps is not None and step > 0
            and step % self.local_every_steps == 0)

  def saved(self, name: str) -> None:
    """The persistent tier saved at the latest step."""
    if self.timer is not None:
      self.timer.saved(name)

  def regroup(self, coord: coordinator_lib.Coordinator, *,
              is_primary: bool) -> None:
    """See `EverySecs.regroup` and `AutoEverySteps.regroup`."""
    if self.timer is not None:
      self.timer.regroup(coord, is_primary=is_primary)
    if self.auto is not None:
      self.auto.regroup(coord, is_primary=is_primary)


class EverySecs:
  """The `every_secs` trigger of one callback; called on every process.

  Args:
    every_secs: the interval.
    clock: seconds as a float (`time.monotonic`, or a fake in tests).
    coord: how processes meet.
    is_primary: whether this process decides for all.
    timeout_ms: how long the others wait for the primary's answer.
  """

  def __init__(self, every_secs: float, clock: Callable[[], float],
               coord: coordinator_lib.Coordinator, *, is_primary: bool,
               timeout_ms: int):
    self.every_secs = every_secs
    self._clock = clock
    self._coord = coord
    self._is_primary = is_primary
    self._timeout_ms = timeout_ms
    self._last_save = clock()
    self._next_ask: int | None = None  # None: ask at the next call.
    self._round = 0  # Saves so far: names a key directory per interval.
    self._asks_now = 0  # Asks in this interval: names the key.
    self._prev: tuple[int, float] | None = None  # Primary: (step, time).
    self._secs_per_step: float | None = None  # Primary: the latest rate.
    self.asks = 0  # How often this process asked in all.

  def regroup(self, coord: coordinator_lib.Coordinator, *,
              is_primary: bool) -> None:
    """Meets `coord`'s processes from now on (the survivors, see
    `elastic`), under a new key prefix: the counts start again (a survivor
    whose save the loss broke did not count it), and the primary may be
    another process."""
    self._coord, self._is_primary = coord, is_primary
    self._next_ask, self._round, self._asks_now = None, 0, 0
    self._prev = self._secs_per_step = None

  def _answer(self, step: int, now: float) -> str:
    """Primary: 'due', or 'next N' (the step at which all ask again)."""
    remaining = self.every_secs - (now - self._last_save)
    if remaining <= 0:
      return "due"
    ahead = 1
    if self._secs_per_step:
      ahead = max(1, math.floor(remaining / self._secs_per_step / 2))
    return f"next {step + ahead}"

  def due(self, step: int, key: str) -> bool:
    """Whether to save at `step`; `key` is a prefix unique to the writer."""
    now = self._clock()
    if self._coord.process_count == 1:
      return now - self._last_save >= self.every_secs
    if self._is_primary:
      prev, self._prev = self._prev, (step, now)
      if prev is not None and step > prev[0]:
        self._secs_per_step = (now - prev[1]) / (step - prev[0])
    if self._next_ask is not None and step < self._next_ask:
      return False
    name = f"{key}/every_secs/{self._round}/{self._asks_now}"
    self._asks_now += 1
    self.asks += 1
    if self._is_primary:
      answer = self._answer(step, now)
      self._coord.kv_set(name, answer)
    else:
      answer = self._coord.kv_get(name, timeout_ms=self._timeout_ms)
    if answer == "due":
      return True
    self._next_ask = int(answer.split()[1])
    return False

  def saved(self, key: str) -> None:
    """A save started: the interval starts again, keys of the last go."""
    self._last_save = self._clock()
    self._next_ask = None
    self._round += 1
    self._asks_now = 0
    if self._is_primary and self._coord.process_count > 1 and self._round >= 2:
      # The save waited for the previous commit, whose barriers every
      # process passed after reading all keys from before that save.
      self._coord.kv_delete(f"{key}/every_secs/{self._round - 2}")
