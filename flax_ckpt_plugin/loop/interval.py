"""`every_steps=AutoInterval(...)`: the Young/Daly interval from measured
costs.

A job that fails on average every M seconds (its mean time between
failures, `AutoInterval(mtbf_secs=)`) and pays C seconds of its own time
for each save loses least, in saves plus work redone after a failure, when
it saves every sqrt(2 C M) seconds of training (Young, 1974; Daly, 2006,
whose higher-order terms change it by less than 1% while C < M / 1000).

The cost C of a save, for a checkpointer whose commit runs in the
background, is what the loop pays for it: the time the loop waited in the
call that saved (the snapshot, and the previous commit if it still ran),
plus the slowdown of the steps that ran while the commit was written in the
background (each such step's time less the time of a step with no save
running). `Costs` measures both from the times at which the callback is
called, along with the step time, and the interval in steps is sqrt(2 C M)
over the step time, within the user's bounds.

Every process must save at the same steps (a save is a collective), but
each measures its own costs. So the primary host decides: at each save it
works out an interval from the costs of its saves so far and publishes it
in the key-value store, before its save starts; every process reads it at
the next save, once that save waited for the previous commit, whose
barriers the primary passed only after publishing: the value is there, and
reading it waits for nobody. An interval decided at one save therefore
applies from the next save on (`AutoEverySteps`, the trigger of the
callback that does all this through the hooks of `triggers.Trigger`): the
steps of the saves follow from the first step, the starting interval and
the published intervals alone, the same on every process.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Any, Callable

from flax_ckpt_plugin import errors
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.multihost import keys

# The starting interval, until a save's cost is measured (within the
# bounds; `min_every_steps` instead when given).
FIRST_EVERY_STEPS = 100
# The cost C is the mean of this many of the newest measured saves.
RECENT_SAVES = 3
# The step time is the median of this many of the newest quiet steps.
RECENT_STEPS = 64

_QUIET, _COMMITTING, _OTHER = "quiet", "committing", "other"


@dataclasses.dataclass(frozen=True)
class AutoInterval:
  """The options of a persistent tier that saves at the interval that loses
  least time to saves and failures: `CheckpointCallback(every_steps=
  AutoInterval(mtbf_secs=3600))` saves every sqrt(2 x C x `mtbf_secs`)
  seconds of training, C being the measured cost of a save to the loop (the
  time the loop waited in the call that saved, plus the slowdown of the
  steps that ran while its commit was written in the background, the mean
  of the last 3 saves), over the measured step time; within the bounds.
  The primary host decides each interval from its own measures, at a save,
  and every process applies it from the next save on, so all save at the
  same steps. See docs/auto_interval.md.

  Attributes:
    mtbf_secs: the job's mean time between failures that cost it the work
      since the last persistent checkpoint (with a local tier: the failures
      it cannot restore from), in seconds. Needed.
    min_every_steps: never save more often than every this many steps
      (also the interval until a save's cost is measured; 100 steps
      without it).
    max_every_steps: never save less often than every this many steps.

  Raises:
    ValueError: no `mtbf_secs`; a value out of its range.
  """
  mtbf_secs: float | None = None
  min_every_steps: int | None = None
  max_every_steps: int | None = None

  def __post_init__(self):
    if self.mtbf_secs is None:
      raise ValueError(
          "AutoInterval saves at the interval that loses least time to"
          " saves and failures, which needs the job's mean time between"
          " failures: pass AutoInterval(mtbf_secs=...)")
    check_interval_options(self.mtbf_secs, self.min_every_steps,
                           self.max_every_steps)


def check_interval_options(mtbf_secs: float | None,
                           min_every_steps: int | None,
                           max_every_steps: int | None) -> None:
  """Checks `AutoInterval`'s values (each may be None: not given).

  Raises:
    ValueError: a value out of its range.
  """
  if mtbf_secs is not None:
    errors.check_secs("mtbf_secs", mtbf_secs)
  for name, value in (("min_every_steps", min_every_steps),
                      ("max_every_steps", max_every_steps)):
    if value is not None:
      errors.check_count(name, value)
  errors.check_at_most("min_every_steps", min_every_steps,
                       "max_every_steps", max_every_steps)


def young_daly_secs(cost_secs: float, mtbf_secs: float) -> float:
  """The interval, in seconds of training, that loses least: sqrt(2 C M)."""
  return math.sqrt(2.0 * cost_secs * mtbf_secs)


@dataclasses.dataclass
class SaveCost:
  """What one save cost the loop, as measured in the loop's thread."""
  blocking_secs: float = 0.0  # The call that saved.
  committing_secs: float = 0.0  # Steps that ran while its commit ran...
  committing_steps: int = 0  # ... and how many.

  def background_secs(self, step_secs: float) -> float:
    """The slowdown of the steps that ran during the commit."""
    return max(0.0, self.committing_secs - self.committing_steps * step_secs)


class Costs:
  """The costs of saves and the step time, from the times of the
  callback's calls (time passed in; called from the loop's thread).

  A step's time is the time from the end of one call of the callback to
  the start of the next (the train step and whatever else the loop does).
  A step that starts while no save runs is quiet: quiet steps give the
  step time. A step that starts while the persistent tier's commit runs
  counts toward that save's background cost. A step that starts while
  only the local tier's commit runs counts toward neither.
  """

  def __init__(self):
    self.quiet: collections.deque[float] = collections.deque(
        maxlen=RECENT_STEPS)
    self.saves: collections.deque[SaveCost] = collections.deque(
        maxlen=RECENT_SAVES)
    self._current: SaveCost | None = None  # The newest save, being measured.
    self._ended: float | None = None  # When the latest call ended.
    self._state = _OTHER  # What ran when it ended.
    self._save_started: float | None = None

  def call_started(self, now: float) -> None:
    """A call of the callback starts: the step before it is measured."""
    if self._ended is None:
      return
    secs = now - self._ended
    if self._state == _QUIET:
      self.quiet.append(secs)
    elif self._state == _COMMITTING and self._current is not None:
      self._current.committing_secs += secs
      self._current.committing_steps += 1

  def call_ended(self, now: float, *, committing: bool, busy: bool) -> None:
    """A call ends; `committing`: the persistent tier's commit runs now;
    `busy`: a commit of either tier runs now."""
    self._ended = now
    self._state = (_COMMITTING if committing
                   else _OTHER if busy else _QUIET)

  def save_started(self, now: float) -> None:
    """A persistent save starts: the previous one's commit is over (the
    save waits for it first), so its cost is complete."""
    if self._current is not None:
      self.saves.append(self._current)
    self._current = None
    self._save_started = now

  def save_ended(self, now: float) -> None:
    """The call that saved returns (the loop waited since `save_started`)."""
    if self._save_started is not None:
      self._current = SaveCost(blocking_secs=now - self._save_started)
    self._save_started = None

  def step_secs(self) -> float | None:
    """The time of a quiet step (the median of the recent ones), or None."""
    return statistics.median(self.quiet) if self.quiet else None


@dataclasses.dataclass(frozen=True)
class Decision:
  """An interval the primary host decided at a save, and why."""
  every_steps: int  # The interval decided.
  reason: str  # Why, in words (for the log).
  saves_measured: int = 0  # How many saves' costs it rests on (0: none).
  cost_secs: float = math.nan  # C: blocking + background, their mean.
  blocking_secs: float = math.nan
  background_secs: float = math.nan
  step_secs: float = math.nan  # The time of a quiet step.
  mtbf_secs: float = math.nan
  young_daly_secs: float = math.nan  # sqrt(2 C M).
  bound: int = 0  # -1: raised to the minimum; 1: cut to the maximum.

  def scalars(self) -> dict[str, float]:
    """The metric writer's scalars of this decision."""
    return {
        "checkpoint/auto_next_every_steps": float(self.every_steps),
        "checkpoint/auto_saves_measured": float(self.saves_measured),
        "checkpoint/auto_cost_secs": self.cost_secs,
        "checkpoint/auto_blocking_secs": self.blocking_secs,
        "checkpoint/auto_background_secs": self.background_secs,
        "checkpoint/auto_step_secs": self.step_secs,
        "checkpoint/auto_mtbf_secs": self.mtbf_secs,
        "checkpoint/auto_young_daly_secs": self.young_daly_secs,
        "checkpoint/auto_bound": float(self.bound),
    }


class Bounds:
  """The bounds of an automatic interval, in steps (None: unbounded)."""

  def __init__(self, min_steps: int | None, max_steps: int | None):
    self.min_steps, self.max_steps = min_steps, max_steps

  def apply(self, steps: int) -> tuple[int, int]:
    """`steps` within the bounds (and >= 1), and which bound applied."""
    if self.min_steps is not None and steps < self.min_steps:
      return self.min_steps, -1
    if self.max_steps is not None and steps > self.max_steps:
      return self.max_steps, 1
    return max(1, steps), 0

  def first(self) -> int:
    """The starting interval."""
    if self.min_steps is not None:
      return self.min_steps
    return self.apply(FIRST_EVERY_STEPS)[0]


def decide(costs: Costs, *, mtbf_secs: float, bounds: Bounds,
           current: int) -> Decision:
  """The interval from `costs` (`current`: the interval in use now).

  With no quiet step yet (every step ran during a commit: the interval is
  shorter than a commit), the interval doubles; with no save measured yet,
  it stays.
  """
  step_secs = costs.step_secs()
  if step_secs is None or step_secs <= 0:
    steps, bound = bounds.apply(2 * current)
    return Decision(steps, "no step ran without a save being written yet:"
                    f" the interval doubles to {steps}", bound=bound)
  if not costs.saves:
    steps, bound = bounds.apply(current)
    return Decision(steps, f"no save measured yet: {steps} steps",
                    step_secs=step_secs, bound=bound)
  saves = list(costs.saves)
  blocking = statistics.fmean(s.blocking_secs for s in saves)
  background = statistics.fmean(s.background_secs(step_secs) for s in saves)
  cost = blocking + background
  secs = young_daly_secs(cost, mtbf_secs)
  steps, bound = bounds.apply(round(secs / step_secs))
  why = (f"sqrt(2 x cost {cost:.3g}s x mtbf {mtbf_secs:.6g}s) ="
         f" {secs:.4g}s = {secs / step_secs:.1f} steps of {step_secs:.3g}s"
         f"; the cost is the mean of the last {len(saves)} saves:"
         f" {blocking:.3g}s blocking + {background:.3g}s of slower steps"
         " while the commit ran")
  if bound:
    why += (f"; {'raised to the minimum' if bound < 0 else 'cut to the maximum'}"
            f" {steps}")
  return Decision(steps, why, saves_measured=len(saves), cost_secs=cost,
                  blocking_secs=blocking, background_secs=background,
                  step_secs=step_secs, mtbf_secs=mtbf_secs,
                  young_daly_secs=secs, bound=bound)


class AutoEverySteps:
  """The trigger of `every_steps=AutoInterval(...)`; called on every
  process. It has every hook of `triggers.Trigger` (without naming it:
  `triggers` imports this module to build it).

  The first save comes `Bounds.first()` steps after the first step the
  callback sees; each save then sets the next save's step from the
  interval the primary decided at the save before (the starting interval
  at the first save). Every process reaches each save at the same step, so
  all read the same intervals and keep the same schedule. Its hooks measure
  the costs of the saves and the step time (`Costs`).

  Args:
    options: the interval's options.
  """

  def __init__(self, options: AutoInterval):
    self.options = options
    self.mtbf_secs = options.mtbf_secs
    self.bounds = Bounds(options.min_every_steps, options.max_every_steps)
    self.costs = Costs()
    self._coord: coordinator_lib.Coordinator | None = None
    self._is_primary = False
    self._timeout_ms = 0
    self.every_steps = self.bounds.first()  # The interval in use.
    self.next_step: int | None = None  # None: set at the first call.
    self._round = 0  # Saves so far: names the key of each decision.
    self._decided: int | None = None  # Primary: its latest decision.
    self.decision: Decision | None = None  # Primary: its latest decision.

  def start(self, coord: coordinator_lib.Coordinator, *, is_primary: bool,
            timeout_ms: int, now: float) -> None:
    """Meets `coord`'s processes (`timeout_ms`: how long a read of the
    primary's interval may wait)."""
    del now
    self._coord, self._is_primary = coord, is_primary
    self._timeout_ms = timeout_ms

  def regroup(self, coord: coordinator_lib.Coordinator, *,
              is_primary: bool) -> None:
    """Meets `coord`'s processes from now on, from the start (see
    `EverySecs.regroup`): the members may have counted the save the loss
    broke differently."""
    self._coord, self._is_primary = coord, is_primary
    self.every_steps, self.next_step = self.bounds.first(), None
    self._round, self._decided, self.decision = 0, None, None

  def due(self, step: int, key: str, now: float) -> bool:
    del key, now
    if self.next_step is None:
      self.next_step = step - 1 + self.every_steps
    return step >= self.next_step

  def on_step_start(self, now: float) -> None:
    self.costs.call_started(now)

  def on_step_end(self, now: float, commits: Callable[[], Any]) -> None:
    running = commits()  # A `triggers.Commits`.
    self.costs.call_ended(now, committing=running.persistent,
                          busy=running.any)

  def on_save_start(self, step: int, key: str, now: float,
                    wait: Callable[[], None]) -> dict[str, float]:
    """Ends the measure of the previous save, waits for its commit (the
    interval the primary published at it is in the key-value store once
    that commit finished; the save would wait for it anyway), and sets the
    next save's step (see `saving`)."""
    self.costs.save_started(now)
    wait()
    return self.saving(step, key)

  def on_saved(self, key: str, now: float) -> None:
    del key, now

  def on_save_end(self, now: float) -> None:
    self.costs.save_ended(now)

  def saving(self, step: int, key: str) -> dict[str, float]:
    """A persistent save at `step` starts, after the previous commit
    finished; `key` is a prefix unique to the writer. Sets the next save's
    step; the primary decides the interval after it.

    Returns:
      The scalars to write with this save (the primary's; else none).
    """
    if self._round > 0:
      self.every_steps = self._read(key, self._round - 1)
    self.next_step = step + self.every_steps
    scalars = {}
    if self._is_primary:
      self.decision = decide(self.costs, mtbf_secs=self.mtbf_secs,
                             bounds=self.bounds, current=self.every_steps)
      self._decided = self.decision.every_steps
      if self._coord.process_count > 1:
        self._coord.kv_set(self._key(key, self._round),
                           str(self._decided))
        if self._round >= 2:  # Every process read it at the last save.
          self._coord.kv_delete(self._key(key, self._round - 2))
      log.info("every_steps='auto': saving step %d; the next save is at"
               " step %d (every %d steps), the interval after it %d steps:"
               " %s", step, self.next_step, self.every_steps, self._decided,
               self.decision.reason)
      scalars = {"checkpoint/auto_every_steps": float(self.every_steps),
                 **self.decision.scalars()}
    self._round += 1
    return scalars

  def _read(self, key: str, round_: int) -> int:
    if self._is_primary or self._coord.process_count == 1:
      return self._decided
    return int(self._coord.kv_get(self._key(key, round_),
                                  timeout_ms=self._timeout_ms))

  @staticmethod
  def _key(key: str, round_: int) -> str:
    return keys.child(key, "auto_every_steps", round_)

