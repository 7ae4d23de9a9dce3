"""When a callback saves: its triggers, each a `Trigger`, decided alike on
every process; and `every_secs`, rarely talking (the schedule of
`every_steps=AutoInterval(...)` is `interval`'s).

Hosts' clocks disagree, so one process (the primary host) decides
`every_secs` and the others must hear its decision before they leave the
step. Asking it at every step would cost every other process a blocking
round trip to the coordination service per step. Instead, each answer that
is "not yet" also names the next step at which to ask again: half the
remaining time at the primary's current step rate. Until that step no
process asks, so a job asks about log2(every_secs / step time) times per
interval instead of once per step. Steps that speed up by more than 2x
between two asks can make a save come a few steps late; never early, and
never on some processes only.
"""

from __future__ import annotations

import math
import operator
import time
import warnings
from typing import Callable, Iterable, NamedTuple, Protocol

from flax_ckpt_plugin.loop import interval
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.tolerance.options import FaultTolerance
from flax_ckpt_plugin.multihost import keys

# The deprecated form of `every_steps=AutoInterval(...)`, and the fields of
# `FaultTolerance` that went with it (see `interval.AutoInterval`).
AUTO = "auto"
_AUTO_FIELDS = ("mtbf_secs", "min_every_steps", "max_every_steps")


def monotonic() -> float:
  """The clock of the triggers: `time.monotonic` (a test may replace this
  function before it makes a callback)."""
  return time.monotonic()


class Commits(NamedTuple):
  """Which commits run in the background as a call of the callback ends."""
  persistent: bool  # The persistent tier's.
  any: bool  # The persistent tier's or the local tier's.


class Trigger(Protocol):
  """One rule of when the persistent tier saves, with the hooks that the
  callback calls on every process, in the loop's thread (`now`: the time of
  `monotonic()`). Every hook but `due` does nothing unless a trigger needs
  it; a subclass overrides those it needs.
  """

  def start(self, coord: coordinator_lib.Coordinator, *, is_primary: bool,
            timeout_ms: int, now: float) -> None:
    """The callback starts, meeting `coord`'s processes (`is_primary`: this
    process decides for all; `timeout_ms`: how long a read of its decision
    may wait)."""

  def due(self, step: int, key: str, now: float) -> bool:
    """Whether `step` is due; `key` is a prefix unique to the writer (for
    keys of the coordination service). Called at every step, the same
    steps on every process."""
    raise NotImplementedError

  def on_step_start(self, now: float) -> None:
    """A call of the callback starts (the step before it ended)."""

  def on_step_end(self, now: float, commits: Callable[[], Commits]) -> None:
    """A call of the callback ends; `commits()` says which commits run."""

  def on_save_start(self, step: int, key: str, now: float,
                    wait: Callable[[], None]) -> dict[str, float]:
    """The persistent tier is about to save `step`; `wait()` waits until
    its previous commit is over.

    Returns:
      Scalars to write with this save (see `CheckpointCallback`'s
      `metric_writer`).
    """
    del step, key, now, wait
    return {}

  def on_saved(self, key: str, now: float) -> None:
    """The persistent tier's save of the step returned (its commit runs)."""

  def on_save_end(self, now: float) -> None:
    """The call that saved (both tiers) returns."""

  def regroup(self, coord: coordinator_lib.Coordinator, *,
              is_primary: bool) -> None:
    """Meets `coord`'s processes from now on (the survivors of a loss, see
    `elastic`), under a new key prefix."""


class EverySteps(Trigger):
  """Saves at every positive multiple of `every_steps`."""

  def __init__(self, every_steps: int):
    self.every_steps = every_steps

  def due(self, step: int, key: str, now: float) -> bool:
    return step > 0 and step % self.every_steps == 0


class AtSteps(Trigger):
  """Saves at the steps listed (`on_steps`, and `last_step`)."""

  def __init__(self, steps: frozenset[int]):
    self.steps = steps

  def due(self, step: int, key: str, now: float) -> bool:
    return step in self.steps


def every_steps_trigger(every_steps: int | interval.AutoInterval | str | None,
                        tolerance: FaultTolerance) -> Trigger | None:
  """The trigger of `every_steps`, its deprecated form (`"auto"` and the
  interval's fields of `FaultTolerance`) taken for one release.

  Raises:
    ValueError: `every_steps` is none of an int >= 1, an `AutoInterval` or
      None; the interval's options are given both ways, or without
      `every_steps="auto"`; `"auto"` without `FaultTolerance(mtbf_secs=)`.
  """
  old = {name: getattr(tolerance, name) for name in _AUTO_FIELDS
         if getattr(tolerance, name) is not None}
  if isinstance(every_steps, interval.AutoInterval):
    if old:
      raise ValueError(
          f"every_steps={every_steps!r} and FaultTolerance("
          f"{', '.join(f'{k}={v!r}' for k, v in old.items())}) both set how"
          " the interval is chosen: give it one way, every_steps="
          "AutoInterval(...), and drop those fields of FaultTolerance")
    return interval.AutoEverySteps(every_steps)
  if isinstance(every_steps, str) and every_steps == AUTO:
    warnings.warn(
        'every_steps="auto" (with FaultTolerance(mtbf_secs=...,'
        " min_every_steps=..., max_every_steps=...)) is deprecated and goes"
        " away in the next release: pass every_steps=AutoInterval("
        "mtbf_secs=...) (and min_every_steps=, max_every_steps= there)",
        DeprecationWarning, stacklevel=4)
    if tolerance.mtbf_secs is None:
      raise ValueError(
          'every_steps="auto" saves at the interval that loses least'
          " time to saves and failures, which needs the job's mean time"
          " between failures: pass tolerance=FaultTolerance(mtbf_secs=...),"
          " or better every_steps=AutoInterval(mtbf_secs=...)")
    return interval.AutoEverySteps(interval.AutoInterval(**old))
  if old:
    raise ValueError(
        f"FaultTolerance({', '.join(f'{k}={v!r}' for k, v in old.items())})"
        ' sets how every_steps="auto" chooses its interval, but every_steps'
        f" is {every_steps!r}: pass every_steps=AutoInterval(...) with them,"
        " or drop them")
  if every_steps is None:
    return None
  if isinstance(every_steps, str) or every_steps < 1:
    raise ValueError("every_steps must be an int >= 1 or an AutoInterval,"
                     f" got {every_steps!r}")
  return EverySteps(every_steps)


class Triggers:
  """When a callback saves, decided alike on every process: to the
  persistent tier when any of its triggers is due (`every_steps`: an int,
  `EverySteps`, or an `interval.AutoInterval`, whose `interval.AutoEverySteps`
  works out the interval from measured costs; `every_secs`, `EverySecs`,
  from `start`; `on_steps` and `last_step`, `AtSteps`); to the local tier
  at every positive multiple of `FaultTolerance(local_every_steps=)`.

  The callback calls each hook below at its moment; each hands it on to
  every trigger with the time.

  Attributes:
    schedule: the trigger of `every_steps`, or None.
    persistent_triggers: every trigger of the persistent tier.

  Raises:
    ValueError: an interval that cannot be kept; the interval's options
      given both ways (see `every_steps_trigger`).
  """

  def __init__(self, *, every_steps: int | interval.AutoInterval | str | None,
               every_secs: float | None, on_steps: Iterable[int],
               last_step: int | None, tolerance: FaultTolerance):
    self.schedule = every_steps_trigger(every_steps, tolerance)
    if every_secs is not None and not every_secs > 0:
      raise ValueError(f"every_secs must be > 0, got {every_secs}")
    self.on_steps = frozenset(operator.index(s) for s in on_steps)
    self.last_step = last_step
    self.local_every_steps = tolerance.local_every_steps
    at = self.on_steps | ({last_step} if last_step is not None else set())
    self.persistent_triggers: tuple[Trigger, ...] = tuple(t for t in (
        EverySecs(every_secs) if every_secs is not None else None,
        self.schedule, AtSteps(at) if at else None) if t is not None)

  def start(self, coord: coordinator_lib.Coordinator, *, is_primary: bool,
            timeout_ms: int) -> None:
    """Starts the triggers (the `every_secs` clock among them), decided by
    the primary of `coord`."""
    now = monotonic()
    for t in self.persistent_triggers:
      t.start(coord, is_primary=is_primary, timeout_ms=timeout_ms, now=now)

  def persistent(self, step: int, name: str) -> bool:
    """Whether `step` is due in the persistent tier (`name`: the manager's,
    for the keys of the coordination service). Asks every trigger: each
    one's decision must be taken at the same steps on every process."""
    now = monotonic()
    return any([t.due(step, name, now) for t in self.persistent_triggers])

  def local(self, step: int) -> bool:
    return (self.local_every_steps is not None and step > 0
            and step % self.local_every_steps == 0)

  def call_started(self) -> None:
    """A call of the callback starts."""
    now = monotonic()
    for t in self.persistent_triggers:
      t.on_step_start(now)

  def call_ended(self, commits: Callable[[], Commits]) -> None:
    """A call of the callback ends (`commits()`: which commits run now)."""
    now = monotonic()
    for t in self.persistent_triggers:
      t.on_step_end(now, commits)

  def save_started(self, step: int, name: str,
                   wait: Callable[[], None]) -> dict[str, float]:
    """The persistent tier is about to save `step` (`wait()`: waits for its
    previous commit); returns the scalars to write with that save."""
    now = monotonic()
    scalars = {}
    for t in self.persistent_triggers:
      scalars.update(t.on_save_start(step, name, now, wait))
    return scalars

  def saved(self, name: str) -> None:
    """The persistent tier saved at the latest step."""
    now = monotonic()
    for t in self.persistent_triggers:
      t.on_saved(name, now)

  def save_ended(self) -> None:
    """The call that saved to the persistent tier returns."""
    now = monotonic()
    for t in self.persistent_triggers:
      t.on_save_end(now)

  def regroup(self, coord: coordinator_lib.Coordinator, *,
              is_primary: bool) -> None:
    """See `Trigger.regroup`."""
    for t in self.persistent_triggers:
      t.regroup(coord, is_primary=is_primary)


class EverySecs(Trigger):
  """The `every_secs` trigger of one callback; called on every process.

  Args:
    every_secs: the interval.
  """

  def __init__(self, every_secs: float):
    self.every_secs = every_secs
    self._coord: coordinator_lib.Coordinator | None = None
    self._is_primary = False
    self._timeout_ms = 0
    self._last_save = 0.0
    self._next_ask: int | None = None  # None: ask at the next call.
    self._round = 0  # Saves so far: names a key directory per interval.
    self._asks_now = 0  # Asks in this interval: names the key.
    self._prev: tuple[int, float] | None = None  # Primary: (step, time).
    self._secs_per_step: float | None = None  # Primary: the latest rate.

  def start(self, coord: coordinator_lib.Coordinator, *, is_primary: bool,
            timeout_ms: int, now: float) -> None:
    """The interval starts now; `coord`'s primary decides it."""
    self._coord, self._is_primary = coord, is_primary
    self._timeout_ms = timeout_ms
    self._last_save = now

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
    """The primary's answer at `step`: 'due', or 'next N' (the step at
    which every process asks again)."""
    remaining = self.every_secs - (now - self._last_save)
    if remaining <= 0:
      return "due"
    ahead = 1
    if self._secs_per_step:
      ahead = max(1, math.floor(remaining / self._secs_per_step / 2))
    return f"next {step + ahead}"

  def due(self, step: int, key: str, now: float) -> bool:
    """Whether to save at `step`; `key` is a prefix unique to the writer."""
    if self._coord.process_count == 1:
      return now - self._last_save >= self.every_secs
    if self._is_primary:
      prev, self._prev = self._prev, (step, now)
      if prev is not None and step > prev[0]:
        self._secs_per_step = (now - prev[1]) / (step - prev[0])
    if self._next_ask is not None and step < self._next_ask:
      return False
    name = keys.child(key, "every_secs", self._round, self._asks_now)
    self._asks_now += 1
    if self._is_primary:
      answer = self._answer(step, now)
      self._coord.kv_set(name, answer)
    else:
      answer = self._coord.kv_get(name, timeout_ms=self._timeout_ms)
    if answer == "due":
      return True
    self._next_ask = int(answer.split()[1])
    return False

  def on_saved(self, key: str, now: float) -> None:
    """A save started: the interval starts again, keys of the last go."""
    self._last_save = now
    self._next_ask = None
    self._round += 1
    self._asks_now = 0
    if self._is_primary and self._coord.process_count > 1 and self._round >= 2:
      # The save waited for the previous commit, whose barriers every
      # process passed after reading all keys from before that save.
      self._coord.kv_delete(keys.child(key, "every_secs", self._round - 2))
