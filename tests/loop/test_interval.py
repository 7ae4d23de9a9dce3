"""Tests of `every_steps=AutoInterval(...)`: the Young/Daly interval from
measured costs (`loop.interval`), in fake time, and its agreement across
processes; and its deprecated form, `every_steps="auto"`."""

import dataclasses
import json
import logging
import math
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

from flax_ckpt_plugin import AutoInterval
from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import FaultTolerance
from flax_ckpt_plugin.loop import interval
from flax_ckpt_plugin.loop import triggers
from flax_ckpt_plugin.multihost import groups
from fake_coordinator import run_threads
from helpers import tiny
from launcher import run_workers

TIMEOUT_MS = 10_000


def _auto(coord=None, *, mtbf_secs, min_steps=None, max_steps=None):
  coord = coord or groups.SoloCoordinator()
  auto = interval.AutoEverySteps(AutoInterval(
      mtbf_secs=mtbf_secs, min_every_steps=min_steps,
      max_every_steps=max_steps))
  auto.start(coord, is_primary=coord.process_index == 0,
             timeout_ms=TIMEOUT_MS, now=0.0)
  return auto


class Loop:
  """A train loop in fake time that calls the trigger's hooks as the
  callback calls them.

  A step lasts `step_secs`; a save blocks the loop `cost(step)[0]` seconds,
  and its commit then slows the next `cost(step)[1]` steps by
  `cost(step)[2]` seconds each. `meet`, if given, is called at each save on
  every process, as the commit's barriers meet them.
  """

  def __init__(self, auto, *, step_secs, cost, meet=None):
    self.auto, self.step_secs, self.cost, self.meet = auto, step_secs, cost, meet
    self.now = 0.0
    self.decisions: dict[int, interval.Decision] = {}

  def run(self, first: int, last: int) -> list[int]:
    saved = []
    commit_left, slow_secs = 0, 0.0
    commits = lambda: triggers.Commits(persistent=commit_left > 0,
                                       any=commit_left > 0)
    for step in range(first, last + 1):
      self.now += self.step_secs + (slow_secs if commit_left > 0 else 0.0)
      commit_left -= 1
      self.auto.on_step_start(self.now)
      if self.auto.due(step, "job", self.now):
        blocking, commit_left, slow_secs = self.cost(step)
        self.auto.on_save_start(step, "job", self.now, wait=lambda: None)
        self.now += blocking
        self.auto.on_saved("job", self.now)
        self.auto.on_save_end(self.now)
        if self.auto.decision is not None:
          self.decisions[step] = self.auto.decision
        if self.meet is not None:
          self.meet(step)
        saved.append(step)
      self.auto.on_step_end(self.now, commits)
    return saved


def _young_daly_steps(cost_secs, mtbf_secs, step_secs):
  return math.sqrt(2 * cost_secs * mtbf_secs) / step_secs


def test_interval_is_young_daly_from_blocking_and_background_cost():
  # A save blocks the loop 3 s, and its commit slows the next 4 steps by
  # 0.5 s each: C = 3 + 2 = 5 s. Steps of 0.5 s, a failure every 4 hours.
  auto = _auto(mtbf_secs=4 * 3600.0)
  loop = Loop(auto, step_secs=0.5, cost=lambda step: (3.0, 4, 0.5))
  saved = loop.run(1, 6000)
  gaps = np.diff([0] + saved).tolist()
  expected = _young_daly_steps(5.0, 4 * 3600.0, 0.5)  # 758.9 steps.
  # The first three gaps are the starting interval: the first save's cost
  # is measured once its commit ended, and applies from the save after.
  assert gaps[:3] == [100, 100, 100]
  assert len(gaps) >= 7
  for gap in gaps[3:]:
    assert abs(gap - expected) <= 0.1 * expected, (gaps, expected)
  last = loop.decisions[saved[-1]]
  assert last.cost_secs == pytest.approx(5.0)
  assert last.blocking_secs == pytest.approx(3.0)
  assert last.background_secs == pytest.approx(2.0)
  assert last.step_secs == pytest.approx(0.5)
  assert last.young_daly_secs == pytest.approx(math.sqrt(2 * 5 * 4 * 3600))
  assert last.every_steps == round(expected) and last.bound == 0
  assert last.saves_measured == interval.RECENT_SAVES


def test_interval_follows_a_change_of_cost():
  # Steps of 1 s, a failure every 1000 s. Saves cost 2 s until step 500,
  # then 18 s (10 s blocking, 4 steps slowed by 2 s): sqrt(2 C M) goes
  # from 63 to 190 steps.
  auto = _auto(mtbf_secs=1000.0, min_steps=20)
  loop = Loop(auto, step_secs=1.0, cost=lambda step: (
      (2.0, 0, 0.0) if step < 500 else (10.0, 4, 2.0)))
  saved = loop.run(1, 2500)
  before = _young_daly_steps(2.0, 1000.0, 1.0)
  after = _young_daly_steps(18.0, 1000.0, 1.0)
  gaps = np.diff(saved).tolist()  # gaps[i]: from saved[i] to the next.
  assert gaps[:2] == [20, 20]
  # The interval after save i is decided at save i - 1 from the costs of
  # saves up to i - 2.
  first_new = next(i for i, s in enumerate(saved) if s >= 500)
  for i in range(2, first_new + 2):
    assert abs(gaps[i] - before) <= 0.1 * before, (i, gaps)
  # It rises as the new cost enters the mean of the last 3 saves...
  rising = gaps[first_new + 1:]
  assert rising == sorted(rising), gaps
  # ... and from the 4th save after the change on, it is the new one.
  assert len(gaps) >= first_new + 7, gaps
  for gap in gaps[first_new + 4:]:
    assert abs(gap - after) <= 0.1 * after, gaps
  assert loop.decisions[saved[-1]].cost_secs == pytest.approx(18.0)


@pytest.mark.parametrize("bounds, expected, bound, why", [
    ((80, None), 80, -1, "raised to the minimum 80"),
    ((None, 50), 50, 1, "cut to the maximum 50"),
], ids=["min", "max"])
def test_interval_is_kept_within_the_bounds(bounds, expected, bound, why):
  auto = _auto(mtbf_secs=1000.0, min_steps=bounds[0], max_steps=bounds[1])
  loop = Loop(auto, step_secs=1.0, cost=lambda step: (2.0, 0, 0.0))  # 63.
  saved = loop.run(1, 1000)
  assert set(np.diff(saved).tolist()[2:]) == {expected}
  last = loop.decisions[saved[-1]]
  assert (last.every_steps, last.bound) == (expected, bound)
  assert why in last.reason
  assert last.young_daly_secs == pytest.approx(math.sqrt(2 * 2 * 1000))


def test_interval_doubles_while_every_step_runs_during_a_commit():
  # It saves at once, and each commit outlasts any interval: no step shows
  # the time of a step without a save, so the cost cannot be told from it.
  auto = _auto(mtbf_secs=1000.0, min_steps=1)
  loop = Loop(auto, step_secs=1.0, cost=lambda step: (1.0, 10_000, 0.5))
  saved = loop.run(1, 300)
  assert saved == [1, 2, 4, 8, 16, 32, 64, 128, 256]
  assert "no step ran without a save being written yet: the interval" \
      " doubles to 512" == loop.decisions[256].reason


def test_every_process_saves_at_the_primary_steps_with_other_measures():
  # Process 1 measures other costs and step times than the primary (alone
  # it would save every 200 steps, the primary every 40), yet both save at
  # the same steps: the primary's.
  def costs(index):
    return ({"step_secs": 1.0, "cost": lambda s: (2.0, 0, 0.0)} if index == 0
            else {"step_secs": 2.0, "cost": lambda s: (200.0, 0, 0.0)})

  def process(coord):
    auto = _auto(coord, mtbf_secs=400.0, min_steps=5)
    meet = lambda step: coord.barrier(f"commit/{step}", timeout_ms=TIMEOUT_MS)
    return Loop(auto, meet=meet, **costs(coord.process_index)).run(1, 400)

  results = run_threads(2, process, timeout=60)
  for r in results:
    assert not isinstance(r, BaseException), r
  alone = [Loop(_auto(mtbf_secs=400.0, min_steps=5), **costs(i)).run(1, 400)
           for i in range(2)]
  assert results == [alone[0], alone[0]]
  assert alone[0] != alone[1]
  assert np.diff(alone[0]).tolist()[2:] == [40] * (len(alone[0]) - 3)


def test_a_new_group_starts_the_schedule_again():
  # After a loss the survivors meet under new keys and may have counted the
  # broken save differently: the schedule starts again from the next call,
  # with the starting interval; the primary's costs measured so far count
  # at once (the first interval decided applies after the second save).
  auto = _auto(mtbf_secs=100.0, min_steps=5)  # sqrt(2 x 2 x 100) = 20.
  loop = Loop(auto, step_secs=1.0, cost=lambda step: (2.0, 0, 0.0))
  assert loop.run(1, 100) == [5, 10, 15, 35, 55, 75, 95]
  auto.regroup(groups.SoloCoordinator(), is_primary=True)
  assert loop.run(101, 200) == [105, 110, 130, 150, 170, 190]


def test_young_daly_secs():
  assert interval.young_daly_secs(5.0, 3600.0) == pytest.approx(
      math.sqrt(36_000))


# -- through the callback ----------------------------------------------------


class CostlyIterator:
  """A data iterator whose state takes `secs` of the fake clock to get: a
  save that blocks the loop for a known time."""

  def __init__(self, clock, secs):
    self.clock, self.secs = clock, secs

  def get_state(self):
    self.clock[0] += self.secs
    return b"position"

  def set_state(self, state):
    del state


class Scalars:
  def __init__(self):
    self.rows = {}

  def write_scalars(self, step, scalars):
    self.rows[step] = scalars


def _run_callback(directory, monkeypatch, **kwargs):
  """A callback in fake time over 199 steps of 1 s, whose saves block the
  loop 2 s (each commit ends before the next step). Returns the steps
  saved, the scalars written at each, and the lines of the interval
  logged."""
  now = [1000.0]
  monkeypatch.setattr(triggers, "monotonic", lambda: now[0])
  writer = Scalars()
  cb = CheckpointCallback(directory, metric_writer=writer, **kwargs)
  cb.restore_or_initialize(tiny(0), data_iterator=CostlyIterator(now, 2.0))
  saved = []
  for step in range(1, 200):
    now[0] += 1.0  # The train step.
    if cb(step, tiny(step)):
      saved.append(step)
      # A commit that ends before the next step: its slowdown is none.
      cb.wait_until_finished()
  cb.close()
  assert cb.manager.all_steps() == saved
  return saved, writer.rows


def test_callback_saves_at_the_measured_interval_and_reports_why(
    ckpt_dir, monkeypatch, caplog):
  with caplog.at_level(logging.INFO, logger="flax_ckpt_plugin"):
    saved, rows = _run_callback(
        ckpt_dir, monkeypatch,
        every_steps=AutoInterval(mtbf_secs=400.0, min_every_steps=5))
  # sqrt(2 x 2 s x 400 s) = 40 s = 40 steps, after 3 starting intervals.
  assert saved == [5, 10, 15, 55, 95, 135, 175]
  row = rows[175]
  assert row["checkpoint/auto_every_steps"] == 40
  assert row["checkpoint/auto_next_every_steps"] == 40
  assert row["checkpoint/auto_cost_secs"] == pytest.approx(2.0)
  assert row["checkpoint/auto_blocking_secs"] == pytest.approx(2.0)
  assert row["checkpoint/auto_background_secs"] == 0.0
  assert row["checkpoint/auto_step_secs"] == pytest.approx(1.0)
  assert row["checkpoint/auto_mtbf_secs"] == 400.0
  assert row["checkpoint/auto_young_daly_secs"] == pytest.approx(40.0)
  assert row["checkpoint/auto_bound"] == 0.0
  assert row["checkpoint/auto_saves_measured"] == 3
  assert rows[5]["checkpoint/auto_saves_measured"] == 0
  assert "checkpoint/blocking_secs" in row
  logged = [r.getMessage() for r in caplog.records
            if "every_steps='auto'" in r.getMessage()]
  assert len(logged) == len(saved)
  assert ("saving step 175; the next save is at step 215 (every 40 steps),"
          " the interval after it 40 steps: sqrt(2 x cost 2s x mtbf 400s) ="
          " 40s = 40.0 steps of 1s") in logged[-1]


def _without_times(rows):
  """The scalars of each step, less those that time the real commit."""
  return {step: {k: v for k, v in row.items() if k.startswith(
      "checkpoint/auto_")} for step, row in rows.items()}


def test_the_deprecated_form_saves_at_the_steps_of_the_new_one(
    tmp_path, monkeypatch):
  new = _run_callback(
      tmp_path / "new", monkeypatch,
      every_steps=AutoInterval(mtbf_secs=400.0, min_every_steps=5,
                               max_every_steps=30))
  with pytest.warns(DeprecationWarning) as caught:
    old = _run_callback(
        tmp_path / "old", monkeypatch, every_steps="auto",
        tolerance=FaultTolerance(mtbf_secs=400.0, min_every_steps=5,
                                 max_every_steps=30))
  assert len(caught) == 2  # FaultTolerance's fields, and "auto".
  assert new[0] == old[0] == [5, 10, 15, 45, 75, 105, 135, 165, 195]
  assert _without_times(new[1]) == _without_times(old[1])
  assert new[1][195]["checkpoint/auto_bound"] == 1.0  # Cut to 30.


def test_the_deprecated_forms_warn_naming_the_new_one(ckpt_dir):
  with pytest.warns(DeprecationWarning) as caught:
    tolerance = FaultTolerance(mtbf_secs=3600.0, min_every_steps=10)
  message = str(caught[0].message)
  assert message.startswith(
      "FaultTolerance(mtbf_secs=3600.0, min_every_steps=10) is deprecated")
  assert ("pass CheckpointCallback(every_steps=AutoInterval(mtbf_secs=3600.0,"
          " min_every_steps=10))") in message
  assert "every_steps=AutoInterval(mtbf_secs=...)" in message
  assert caught[0].filename == __file__  # Points at the caller.
  with pytest.warns(DeprecationWarning) as caught:
    CheckpointCallback(ckpt_dir, every_steps="auto",
                       tolerance=tolerance).close()
  message = str(caught[0].message)
  assert message.startswith('every_steps="auto"')
  assert "is deprecated" in message
  assert "pass every_steps=AutoInterval(mtbf_secs=...)" in message
  assert caught[0].filename == __file__


def test_the_new_form_does_not_warn(ckpt_dir):
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    CheckpointCallback(ckpt_dir, every_steps=AutoInterval(
        mtbf_secs=3600.0, min_every_steps=10, max_every_steps=1000)).close()


@pytest.mark.parametrize("old", [
    {"mtbf_secs": 60.0}, {"min_every_steps": 10}, {"max_every_steps": 10}],
    ids=["mtbf_secs", "min_every_steps", "max_every_steps"])
def test_both_forms_at_once_are_refused(ckpt_dir, old):
  with pytest.warns(DeprecationWarning):
    tolerance = FaultTolerance(**old)
  with pytest.raises(ValueError) as e:
    CheckpointCallback(ckpt_dir, every_steps=AutoInterval(mtbf_secs=3600.0),
                       tolerance=tolerance)
  (name, value), = old.items()
  assert str(e.value) == (
      "every_steps=AutoInterval(mtbf_secs=3600.0, min_every_steps=None,"
      f" max_every_steps=None) and FaultTolerance({name}={value!r}) both"
      " set how the interval is chosen: give it one way, every_steps="
      "AutoInterval(...), and drop those fields of FaultTolerance")
  assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir())


@pytest.mark.parametrize("kwargs, message", [
    ({}, "AutoInterval saves at the interval that loses least time to saves"
     " and failures, which needs the job's mean time between failures: pass"
     " AutoInterval(mtbf_secs=...)"),
    ({"mtbf_secs": 0}, "mtbf_secs must be a number of seconds > 0, got 0"),
    ({"mtbf_secs": math.inf},
     "mtbf_secs must be a number of seconds > 0, got inf"),
    ({"mtbf_secs": True}, "mtbf_secs must be a number of seconds > 0, got"
     " True"),
    ({"mtbf_secs": "1h"}, "mtbf_secs must be a number of seconds > 0, got"
     " '1h'"),
    ({"mtbf_secs": 60, "min_every_steps": 0},
     "min_every_steps must be an int >= 1, got 0"),
    ({"mtbf_secs": 60, "max_every_steps": 2.5},
     "max_every_steps must be an int >= 1, got 2.5"),
    ({"mtbf_secs": 60, "min_every_steps": 10, "max_every_steps": 5},
     "min_every_steps=10 is above max_every_steps=5"),
], ids=["no_mtbf", "mtbf_zero", "mtbf_inf", "mtbf_bool", "mtbf_str",
        "min_zero", "max_float", "min_above_max"])
def test_auto_interval_refuses_values_out_of_range(kwargs, message):
  with pytest.raises(ValueError) as e:
    AutoInterval(**kwargs)
  assert str(e.value) == message


def test_auto_interval_is_immutable():
  options = AutoInterval(mtbf_secs=60)
  with pytest.raises(dataclasses.FrozenInstanceError):
    options.mtbf_secs = 30  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, message", [
    ({"every_steps": "auto"}, "needs the job's mean time between failures:"
     " pass tolerance=FaultTolerance(mtbf_secs=...)"),
    ({"every_steps": 100, "tolerance": {"mtbf_secs": 3600.0}},
     "FaultTolerance(mtbf_secs=3600.0) sets how every_steps=\"auto\" chooses"
     " its interval, but every_steps is 100"),
    ({"tolerance": {"max_every_steps": 10}},
     "FaultTolerance(max_every_steps=10) sets how every_steps=\"auto\""),
    ({"every_steps": "often"}, "every_steps must be an int >= 1 or an"
     " AutoInterval, got 'often'"),
], ids=["auto_without_mtbf", "mtbf_without_auto", "bound_without_auto",
        "other_string"])
def test_callback_refuses_options_of_auto_that_do_not_fit(ckpt_dir, kwargs,
                                                          message):
  with warnings.catch_warnings():  # Asserted above; here: the errors.
    warnings.simplefilter("ignore", DeprecationWarning)
    if "tolerance" in kwargs:
      kwargs = {**kwargs, "tolerance": FaultTolerance(**kwargs["tolerance"])}
    with pytest.raises(ValueError) as e:
      CheckpointCallback(ckpt_dir, **kwargs)
  assert message in str(e.value)
  assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wait", ["1", "0"],
                         ids=["commit_waited", "commit_beside_steps"])
def test_processes_with_other_measures_save_at_the_same_steps(tmp_path, wait):
  # Each process's fake clock runs at its own step time and save cost; the
  # primary's alone set the interval (see mp_workers/auto_interval.py). The
  # fake clocks do not see the commits, which slow no step of them.
  results = run_workers("auto_interval", 2,
                        args=[str(tmp_path / "ckpt"), wait], timeout=100)
  out = [r.json for r in results]
  primary = [5, 10, 15, 35, 55, 75, 95]  # sqrt(2 x 2 s x 100 s) / 1 s = 20.
  assert out[0]["saved"] == out[1]["saved"] == primary
  assert out[0]["all_steps"] == out[1]["all_steps"] == primary
  # Process 1 alone would have saved every sqrt(2 x 32 x 100) / 2 = 40.
  assert out[1]["local"] == {"cost_secs": 32.0, "step_secs": 2.0}
  assert out[0]["local"] == {"cost_secs": 2.0, "step_secs": 1.0}


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_auto_interval_benchmark_chooses_what_its_figures_say(tmp_path):
  """benchmarks/auto_interval.py, tiny: a real loop, real saves and the real
  clock; each interval decided is sqrt(2 C M) over the step time (or a
  bound), from the figures the same save reports."""
  script = (pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
            / "auto_interval.py")
  out = tmp_path / "auto.json"
  proc = subprocess.run(
      [sys.executable, str(script), "--layers", "2", "--width", "128",
       "--steps", "60", "--mtbf", "5", "--min-every", "4", "--dir",
       str(tmp_path), "--json", str(out)], capture_output=True, text=True,
      timeout=180, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  saves = result["saves"]
  assert [s["step"] for s in saves] == result["saved"]
  assert result["saved"][:3] == [4, 8, 12]  # The starting interval.
  assert saves[0]["auto_saves_measured"] == 0
  measured = [s for s in saves if s["auto_saves_measured"]]
  assert measured
  for s in measured:
    steps = round(s["auto_young_daly_secs"] / s["auto_step_secs"])
    assert s["auto_next_every_steps"] == max(4, steps), s
    assert s["auto_cost_secs"] == pytest.approx(
        s["auto_blocking_secs"] + s["auto_background_secs"])
  for before, after in zip(saves, saves[1:]):  # Each from the save before.
    assert after["auto_every_steps"] == before["auto_next_every_steps"]
    assert after["step"] - before["step"] == before["auto_every_steps"]
  assert sorted(os.listdir(tmp_path)) == ["auto.json"]
