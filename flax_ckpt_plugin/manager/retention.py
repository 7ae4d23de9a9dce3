"""Which finalized steps a directory keeps: the retention rules.

A step is kept if any rule keeps it:

* the newest finalized step, always;
* the newest step known to restore (`protect`), always;
* `max_to_keep`: the newest N steps;
* `keep_every_n_steps`: every step divisible by N, forever;
* `keep_every_secs`: one step per N seconds of the steps' recorded times
  (the oldest step, then each finished N seconds or more after the last
  one this rule keeps), forever;
* `keep_for_secs`: the steps finished less than N seconds ago (a time to
  live: older ones go unless another rule keeps them);
* `keep_best`: the N steps with the best value of `best_metric` ('min' or
  'max'); ties go to the newer step;
* `keep_without_metric`: with `keep_best`, every step that has no value of
  the metric (a null value, which is how NaN is stored, counts as none).

With none of `max_to_keep`, `keep_best` and `keep_for_secs` set, every
step is kept. A step's time is the one its manifest records
(`created_unix`, written as the step is finalized); a step without one is
kept by the time rules.
`Policy.reasons` names the rules that keep each step; `flax-ckpt list`
prints them from the policy recorded in the newest step's manifest.

The decision must be the same on every process. Without `keep_best` and
the time rules it depends on the list of steps alone, which every process
knows. With them, it depends on metrics, times and the clock, which the
primary host's manifests record and its clock reads: the primary decides
and the others learn its list (see `CheckpointManager`).

Retention's deletes run in the background (`deletions`); with
`wait_for_deletes` a save writes only once the deletes of the previous
one are done.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import (Any, Callable, Literal, Mapping, MutableMapping,
                    NamedTuple, Sequence)

from etils import epath

from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin import errors
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.multihost import meetings

BestMode = Literal["min", "max"]

NEWEST = "newest"
RESTORABLE = "restorable"


def now() -> float:
  """The clock of `keep_for_secs`: `time.time`, the clock of the steps'
  recorded times (a test may replace this function)."""
  return time.time()


class StepRecord(NamedTuple):
  """What retention reads of a step: its metrics and its time."""
  metrics: Any  # `save(metrics=...)`, as recorded; None if none.
  time: float | None  # Seconds since the epoch; None if not recorded.


@dataclasses.dataclass(frozen=True)
class Retention:
  """What a checkpoint directory keeps: which finalized steps retention
  deletes, and which it never does.

  `CheckpointCallback(retention=...)`, `CheckpointManager(retention=...)`.
  The everyday rule, `max_to_keep`, is also a keyword of both (give it one
  way: the two must agree). Every step is kept by default, as Orbax does.

  Attributes:
    max_to_keep: keep the newest N finalized steps (None: every step, unless
      `keep_best` says otherwise).
    keep_every_n_steps: also keep every step divisible by N, forever.
    keep_best: also keep the N steps with the best `best_metric`, as
      recorded by `save(metrics=...)` on the primary host.
    best_metric: the key of `metrics=` that ranks steps for `keep_best`.
    best_mode: 'min' (a loss) or 'max' (an accuracy).
    keep_without_metric: with `keep_best`, keep the steps saved without a
      value of `best_metric` (or with NaN); False leaves them to the other
      rules.
    keep_every_secs: also keep one step per this many seconds, forever:
      the oldest step, then each step finished at least this long after
      the last one this rule keeps (by the times the steps' manifests
      record).
    keep_for_secs: keep the steps finished less than this many seconds
      ago; older ones are deleted unless another rule keeps them (the
      newest finalized step and the newest known to restore always are).
    wait_for_deletes: bound the disk use: a save writes only once the
      deletes of the previous save's retention are done (at most the kept
      steps and the one being written are on disk). False (default):
      deletes run in the background and never make a save wait.
  """
  max_to_keep: int | None = None
  keep_every_n_steps: int | None = None
  keep_best: int | None = None
  best_metric: str | None = None
  best_mode: BestMode = "min"
  keep_without_metric: bool = True
  keep_every_secs: float | None = None
  keep_for_secs: float | None = None
  wait_for_deletes: bool = False

  def __post_init__(self):
    for name in ("max_to_keep", "keep_every_n_steps", "keep_best"):
      errors.check_count(name, getattr(self, name), or_none=True)
    for name in ("keep_every_secs", "keep_for_secs"):
      errors.check_secs(name, getattr(self, name), or_none=True)
    if not isinstance(self.wait_for_deletes, bool):
      raise ValueError("wait_for_deletes must be True or False, got"
                       f" {self.wait_for_deletes!r}")
    if self.keep_best is not None and not self.best_metric:
      raise ValueError(
          f"keep_best={self.keep_best} needs best_metric, the name of the"
          " metric passed to save(metrics=...) that ranks the steps")
    if self.best_metric is not None and not isinstance(self.best_metric, str):
      raise ValueError(f"best_metric must be a str, got {self.best_metric!r}")
    if self.best_mode not in ("min", "max"):
      raise ValueError(
          f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
    if not isinstance(self.keep_without_metric, bool):
      raise ValueError("keep_without_metric must be True or False, got"
                       f" {self.keep_without_metric!r}")


@dataclasses.dataclass(frozen=True)
class Policy(Retention):
  """The retention rules of one checkpoint directory (`Retention`'s
  attributes), and what follows from them."""

  @classmethod
  def of(cls, max_to_keep: int | None, rules: Retention | None) -> "Policy":
    """The policy of the `max_to_keep` keyword and the `retention` record.

    Raises:
      ValueError: both give `max_to_keep`, and not the same.
    """
    rules = rules or Retention()
    if (max_to_keep is not None and rules.max_to_keep is not None
        and max_to_keep != rules.max_to_keep):
      raise ValueError(
          f"max_to_keep={max_to_keep} and retention=Retention(max_to_keep="
          f"{rules.max_to_keep}) disagree: give it one way")
    if max_to_keep is not None:
      rules = dataclasses.replace(rules, max_to_keep=max_to_keep)
    return cls(**dataclasses.asdict(rules))

  @property
  def deletes(self) -> bool:
    """Whether any step can ever be deleted."""
    return (self.max_to_keep is not None or self.keep_best is not None
            or self.keep_for_secs is not None)

  @property
  def needs_records(self) -> bool:
    """Whether the decision depends on the steps' metrics or times (or
    the clock), which the primary host reads: then it decides for all."""
    return (self.keep_best is not None or self.keep_every_secs is not None
            or self.keep_for_secs is not None)

  def metric_of(self, metrics: Any) -> float | None:
    """The ranking value in a step's recorded `metrics`, or None."""
    if not isinstance(metrics, Mapping):
      return None
    value = metrics.get(self.best_metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return None
    return None if math.isnan(value) else float(value)

  def reasons(self, steps: Sequence[int],
              metrics: Mapping[int, Any] | None = None,
              protect: int | None = None, *,
              times: Mapping[int, float | None] | None = None,
              at: float | None = None) -> dict[int, list[str]]:
    """The rules that keep each step; steps with none are deleted.

    Args:
      steps: the finalized steps.
      metrics: per step, its recorded `metrics` (needed for `keep_best`;
        a step missing here has no metric).
      protect: the newest step known to restore.
      times: per step, its recorded time in seconds since the epoch
        (needed for `keep_every_secs` and `keep_for_secs`; a step missing
        here, or with None, has no time, and the time rules keep it).
      at: the time now, for `keep_for_secs` (default: `now()`).
    """
    steps = sorted(set(steps))
    why: dict[int, list[str]] = {s: [] for s in steps}
    if not steps:
      return why
    if not self.deletes:
      for s in steps:
        why[s].append("all (no max_to_keep or keep_best)")
      return why
    why[steps[-1]].append(NEWEST)
    if protect in why and protect != steps[-1]:
      why[protect].append(RESTORABLE)
    if self.max_to_keep is not None:
      for s in steps[-self.max_to_keep:]:
        why[s].append(f"newest {self.max_to_keep}")
    if self.keep_every_n_steps:
      for s in steps:
        if s % self.keep_every_n_steps == 0:
          why[s].append(f"every {self.keep_every_n_steps} steps")
    if self.keep_every_secs is not None or self.keep_for_secs is not None:
      self._by_time(why, steps, times or {}, now() if at is None else at)
    if self.keep_best is not None:
      metrics = metrics or {}
      ranked, unranked = [], []
      for s in steps:
        value = self.metric_of(metrics.get(s))
        (unranked if value is None else ranked).append((value, s))
      sign = 1 if self.best_mode == "min" else -1
      ranked.sort(key=lambda vs: (sign * vs[0], -vs[1]))
      label = f"best {self.keep_best} by {self.best_metric} ({self.best_mode})"
      for _, s in ranked[:self.keep_best]:
        why[s].append(label)
      if self.keep_without_metric:
        for _, s in unranked:
          why[s].append(f"no {self.best_metric} (keep_without_metric)")
    return why

  def _by_time(self, why: dict[int, list[str]], steps: list[int],
               times: Mapping[int, float | None], at: float) -> None:
    """Adds the reasons of `keep_every_secs` and `keep_for_secs`."""
    timed = [(s, times.get(s)) for s in steps]
    for s, t in timed:
      if t is None or not math.isfinite(t):
        why[s].append("no recorded time")
    timed = [(s, t) for s, t in timed if t is not None and math.isfinite(t)]
    if self.keep_every_secs is not None:
      # The oldest, then the first at least the interval after the last
      # kept: once kept, a step stays kept as newer steps come and others
      # go (what is before it is the same each time).
      last = None
      for s, t in timed:
        if last is None or t - last >= self.keep_every_secs:
          why[s].append(f"every {_secs(self.keep_every_secs)}")
          last = t
    if self.keep_for_secs is not None:
      for s, t in timed:
        if at - t < self.keep_for_secs:
          why[s].append(f"younger than {_secs(self.keep_for_secs)}")

  def to_delete(self, steps: Sequence[int],
                metrics: Mapping[int, Any] | None = None,
                protect: int | None = None, *,
                times: Mapping[int, float | None] | None = None,
                at: float | None = None) -> list[int]:
    """The finalized steps that retention removes, oldest first (see
    `reasons` for the arguments)."""
    return [s for s, rules in self.reasons(steps, metrics, protect,
                                           times=times, at=at).items()
            if not rules]

  def to_json(self) -> dict[str, Any]:
    """The policy as recorded in a manifest's 'retention' entry
    (`max_to_keep` first)."""
    return dataclasses.asdict(self)  # max_to_keep first, as it always was.

  @classmethod
  def from_json(cls, value: Any) -> "Policy | None":
    """A recorded policy, or None if absent or not one (informational)."""
    if not isinstance(value, dict):
      return None
    names = {f.name for f in dataclasses.fields(cls)}
    try:
      return cls(**{k: v for k, v in value.items() if k in names})
    except (TypeError, ValueError):
      return None


def _secs(secs: float) -> str:
  """'90s', '2h', '1.5d': a rule's interval, for `reasons`."""
  for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
    if secs >= size and secs % (size / 2) == 0:
      return f"{secs / size:g}{unit}"
  return f"{secs:g}s"


def recorded(directory: epath.Path, backend: interface.Backend,
             step: int) -> StepRecord:
  """The metrics and time in `step`'s manifest; neither if unreadable."""
  try:
    m = manifest_lib.read(directory / str(step), step, backend)
  except (OSError, CheckpointCorruptedError) as e:
    log.warning("retention: cannot read the manifest of step %d in %s (%s);"
                " it counts as a step without metrics or time", step,
                directory, e)
    return StepRecord(None, None)
  return StepRecord(m.metrics, m.created_unix)


def decided_by_primary(policy: Policy, meeting: meetings.Meeting,
                       steps: list[int], *, protect: int | None,
                       records: MutableMapping[int, StepRecord],
                       read_record: Callable[[int], StepRecord],
                       is_primary: bool) -> list[int]:
  """The steps to delete by a policy that reads the steps' metrics or
  times, the same on all.

  Called by every process after a finalized save, with a meeting of that
  save. The primary decides from its records (`records`, filled in with
  `read_record(step)` for steps it has not seen, such as those of an
  earlier run) and its clock, and shares its list; the others, whose own
  metrics and clocks may differ, take it (`meetings.decided_by_one`).

  Raises:
    Exception: the primary's error while deciding (on the others, a
      RuntimeError naming it); nothing is deleted then.
  """

  def decide() -> list[int]:
    for step in steps:
      if step not in records:
        records[step] = read_record(step)
    return policy.to_delete(
        steps, {s: records[s].metrics for s in steps}, protect,
        times={s: records[s].time for s in steps})

  doomed = meetings.decided_by_one(
      meeting, decide, decides=is_primary,
      what=f"retention after step {steps[-1]}",
      consequence="the step is finalized; older steps are left")
  for step in doomed:
    records.pop(step, None)
  return doomed
