"""Retention: the newest N, every K-th, the best N by a metric, one step
per interval of time, the steps younger than a time to live.

The rules themselves (`retention.Policy`), then what a user of the manager
and the callback sees in the directory, across a restart, with several
processes whose metrics differ, and what `flax-ckpt list` prints; the
example of docs/retention.md runs as shown.
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.tools import cli
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.manager import retention as retention_lib
from flax_ckpt_plugin.manager.retention import Policy
from flax_ckpt_plugin import Processes
from flax_ckpt_plugin import FaultTolerance
from flax_ckpt_plugin import Retention
from fake_coordinator import run_threads
from launcher import REPO_ROOT
from launcher import run_workers

LOSSES = {100: 0.9, 200: 0.5, 300: 0.7, 400: 0.3, 500: 0.6, 600: 0.8}


def finalized_steps_on_disk(directory) -> list[int]:
  """What `ls` shows as finalized steps: `<step>/_COMMITTED` exists."""
  return sorted(int(n) for n in os.listdir(directory)
                if n.isdigit() and (directory / n / "_COMMITTED").exists())


def _state(step: int) -> dict:
  return {"w": np.full(4, step, np.float32)}


# -- the rules -----------------------------------------------------------------


def test_best_n_by_min_and_max_with_the_newest_always_kept():
  steps = list(LOSSES)
  metrics = {s: {"loss": v} for s, v in LOSSES.items()}
  lowest = Policy(keep_best=2, best_metric="loss")
  assert lowest.to_delete(steps, metrics) == [100, 300, 500]  # 600: newest.
  highest = Policy(keep_best=2, best_metric="loss", best_mode="max")
  assert highest.to_delete(steps, metrics) == [200, 300, 400, 500]
  why = lowest.reasons(steps, metrics)
  assert why[400] == ["best 2 by loss (min)"] and why[600] == ["newest"]


def test_rules_add_up_and_a_step_is_kept_if_any_rule_keeps_it():
  policy = Policy(max_to_keep=2, keep_every_n_steps=300, keep_best=1,
                  best_metric="loss")
  metrics = {s: {"loss": v} for s, v in LOSSES.items()}
  why = policy.reasons(list(LOSSES), metrics, protect=100)
  assert why == {
      100: ["restorable"],
      200: [],
      300: ["every 300 steps"],
      400: ["best 1 by loss (min)"],
      500: ["newest 2"],
      600: ["newest", "newest 2", "every 300 steps"],
  }
  assert policy.to_delete(list(LOSSES), metrics, protect=100) == [200]


def test_steps_without_the_metric_follow_the_explicit_option():
  metrics = {1: {"loss": 0.5}, 2: {"acc": 0.9}, 3: None, 4: {"loss": None},
             5: {"loss": float("nan")}, 6: {"loss": 0.7}, 7: {"loss": True}}
  keep = Policy(keep_best=1, best_metric="loss")
  assert keep.to_delete(range(1, 9), metrics) == [6]  # 8: newest, no metric.
  assert keep.reasons(range(1, 9), metrics)[3] == [
      "no loss (keep_without_metric)"]
  drop = Policy(keep_best=1, best_metric="loss", keep_without_metric=False)
  assert drop.to_delete(range(1, 9), metrics) == [2, 3, 4, 5, 6, 7]


def test_ties_go_to_the_newer_step():
  metrics = {1: {"loss": 0.5}, 2: {"loss": 0.5}, 3: {"loss": 0.9}}
  assert Policy(keep_best=1, best_metric="loss").to_delete(
      [1, 2, 3], metrics) == [1]


def test_without_max_to_keep_or_keep_best_nothing_is_deleted():
  assert Policy(keep_every_n_steps=2).to_delete([1, 2, 3]) == []
  assert Policy().reasons([1])[1] == ["all (no max_to_keep or keep_best)"]


@pytest.mark.parametrize("kwargs,message", [
    ({"keep_best": 2}, "keep_best=2 needs best_metric"),
    ({"keep_best": 0, "best_metric": "loss"}, "keep_best must be an int >= 1"),
    ({"keep_best": 1, "best_metric": "loss", "best_mode": "lowest"},
     "best_mode must be 'min' or 'max', got 'lowest'"),
    ({"max_to_keep": 0}, "max_to_keep must be an int >= 1 or None, got 0"),
    ({"keep_best": 1, "best_metric": "loss", "keep_without_metric": "yes"},
     "keep_without_metric must be True or False"),
    ({"keep_every_secs": 0}, "keep_every_secs must be a number of seconds"
                             " > 0 or None, got 0"),
    ({"keep_for_secs": -5.0}, "keep_for_secs must be a number of seconds > 0"),
    ({"keep_for_secs": math.inf}, "keep_for_secs must be a number of seconds"),
    ({"keep_every_secs": "60"}, "keep_every_secs must be a number of seconds"),
    ({"keep_for_secs": True}, "keep_for_secs must be a number of seconds"),
    ({"wait_for_deletes": "yes"}, "wait_for_deletes must be True or False"),
])
def test_bad_policies_are_refused_with_a_clear_error(tmp_path, kwargs,
                                                      message):
  keep = kwargs.pop("max_to_keep", None)

  def make(cls, path):
    return cls(path, max_to_keep=keep, retention=Retention(**kwargs))

  with pytest.raises(ValueError, match=re.escape(message)):
    make(CheckpointManager, tmp_path)
  with pytest.raises(ValueError, match=re.escape(message)):
    make(CheckpointCallback, tmp_path / "cb")
  assert not (tmp_path / "cb").exists()


def test_a_recorded_policy_round_trips_and_bad_ones_are_ignored():
  policy = Policy(max_to_keep=3, keep_every_n_steps=10, keep_best=2,
                  best_metric="acc", best_mode="max",
                  keep_without_metric=False, keep_every_secs=3600.0,
                  keep_for_secs=86400, wait_for_deletes=True)
  assert Policy.from_json(json.loads(json.dumps(policy.to_json()))) == policy
  assert Policy.from_json({"keep_best": 2}) is None  # No metric: not one.
  assert Policy.from_json("newest") is None


# -- the time rules --------------------------------------------------------------

# Steps 1..10, finished 10 s apart (with some jitter), from t = 1000.
TIMES = {s: 1000.0 + 10 * (s - 1) + (0.5 if s % 2 else 0.0)
         for s in range(1, 11)}


def test_keep_every_secs_keeps_one_step_per_interval_of_finish_time():
  policy = Policy(max_to_keep=2, keep_every_secs=25)
  why = policy.reasons(list(TIMES), times=TIMES)
  # The oldest, then the first finished 25 s or more after the last kept.
  assert [s for s in TIMES if "every 25s" in why[s]] == [1, 4, 7, 10]
  assert policy.to_delete(list(TIMES), times=TIMES) == [2, 3, 5, 6, 8]
  # Once kept, always kept: the same steps with the others gone and more
  # to come.
  later = {s: TIMES[s] for s in (1, 4, 7, 9, 10)} | {11: 1100.0, 12: 1121.0}
  assert policy.to_delete(list(later), times=later) == [9]  # 11: newest 2.
  assert Policy(keep_every_secs=25).to_delete(list(TIMES), times=TIMES) == []


def test_keep_for_secs_deletes_older_steps_but_the_newest_and_restorable():
  policy = Policy(keep_for_secs=35)
  at = TIMES[10] + 1  # 1091: steps finished after 1056 are young.
  why = policy.reasons(list(TIMES), times=TIMES, at=at)
  assert [s for s in TIMES if "younger than 35s" in why[s]] == [7, 8, 9, 10]
  assert policy.to_delete(list(TIMES), times=TIMES, at=at) == [1, 2, 3, 4, 5,
                                                               6]
  # Much later, every step is old: the newest stays, and the newest known
  # to restore (when it is another).
  assert policy.to_delete(list(TIMES), times=TIMES, at=at + 1e6) == list(
      range(1, 10))
  assert policy.to_delete(list(TIMES), times=TIMES, at=at + 1e6,
                          protect=8) == [1, 2, 3, 4, 5, 6, 7, 9]
  # With the other rules, a step is kept if any rule keeps it.
  both = Policy(keep_for_secs=35, max_to_keep=5, keep_every_n_steps=3)
  assert both.to_delete(list(TIMES), times=TIMES, at=at) == [1, 2, 4, 5]
  # A step without a recorded time is never taken for an old one.
  assert policy.to_delete(list(TIMES), times={**TIMES, 2: None},
                          at=at) == [1, 3, 4, 5, 6]


# -- the manager ---------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch):
  """The retention clock, faked: `clock[0]` is the time now."""
  now = [1_000_000.0]
  monkeypatch.setattr(retention_lib, "now", lambda: now[0])
  return now


def test_manager_keeps_one_step_per_minute_by_the_fake_clock(tmp_path,
                                                              clock):
  with CheckpointManager(
      tmp_path, retention=Retention(max_to_keep=1, keep_every_secs=60)
  ) as mgr:
    for step in range(1, 22):  # One save every 10 s.
      mgr.save(step, _state(step))
      mgr.wait_until_finished()
      clock[0] += 10
  assert finalized_steps_on_disk(tmp_path) == [1, 7, 13, 19, 21]


def test_manager_deletes_steps_older_than_keep_for_secs(tmp_path, clock):
  with CheckpointManager(tmp_path,
                         retention=Retention(keep_for_secs=25)) as mgr:
    for step in range(1, 8):
      mgr.save(step, _state(step))
      mgr.wait_until_finished()
      clock[0] += 10
    assert mgr.all_steps() == [5, 6, 7]
  assert finalized_steps_on_disk(tmp_path) == [5, 6, 7]
  manifest = json.loads((tmp_path / "7" / "manifest.json").read_text())
  assert manifest["retention"]["keep_for_secs"] == 25


def test_a_restarted_job_ages_the_steps_of_the_earlier_run(tmp_path,
                                                           monkeypatch):
  """The steps of an earlier run are aged by their manifests' times."""
  with CheckpointManager(tmp_path) as mgr:
    for step in (1, 2, 3):
      mgr.save(step, _state(step))
  times = [manifest_lib.read(tmp_path / str(s), s).created_unix
           for s in (1, 2, 3)]
  later = max(times) + 3600  # The job restarts an hour later.
  monkeypatch.setattr(retention_lib, "now", lambda: later)
  with CheckpointManager(tmp_path,
                         retention=Retention(keep_for_secs=1800)) as mgr:
    mgr.save(4, _state(4))
  assert finalized_steps_on_disk(tmp_path) == [4]


def test_processes_agree_on_the_primary_s_times(tmp_path, clock):
  """The time rules are decided by the primary, for all."""

  def work(coord):
    with CheckpointManager(
        tmp_path, retention=Retention(max_to_keep=1, keep_every_secs=30),
        processes=Processes(coordinator=coord,
                            barrier_timeout_secs=30)) as mngr:
      for step in range(1, 8):
        mngr.save(step, _state(step))
        mngr.wait_until_finished()
        if coord.process_index == 0:
          clock[0] += 10  # (One clock for both threads: the primary's.)
      return mngr.all_steps()

  results = run_threads(2, work)
  assert results == [[1, 4, 7], [1, 4, 7]], results
  assert finalized_steps_on_disk(tmp_path) == [1, 4, 7]


def test_manager_keeps_the_best_and_records_its_policy(tmp_path):
  with CheckpointManager(
      tmp_path, max_to_keep=1,
      retention=Retention(keep_best=2, best_metric="loss")) as mngr:
    for step, loss in LOSSES.items():
      mngr.save(step, _state(step), metrics={"loss": loss})
      mngr.wait_until_finished()
    assert mngr.all_steps() == [200, 400, 600]
  assert finalized_steps_on_disk(tmp_path) == [200, 400, 600]
  recorded = Policy.from_json(manifest_lib.read(tmp_path / "600",
                                                600).retention)
  assert recorded == Policy(max_to_keep=1, keep_best=2,
                           best_metric="loss")


def test_a_restarted_job_ranks_the_steps_of_the_earlier_run(tmp_path):
  """The metrics of steps saved before a restart come from the manifests."""
  with CheckpointManager(
      tmp_path, max_to_keep=1,
      retention=Retention(keep_best=1, best_metric="loss")) as mngr:
    for step in (100, 200, 300):
      mngr.save(step, _state(step), metrics={"loss": LOSSES[step]})
    mngr.wait_until_finished()
    assert mngr.all_steps() == [200, 300]
  with CheckpointManager(
      tmp_path, max_to_keep=1,
      retention=Retention(keep_best=1, best_metric="loss")) as mngr:
    mngr.save(500, _state(500), metrics={"loss": LOSSES[500]})
    mngr.wait_until_finished()
    assert mngr.all_steps() == [200, 500]  # 300 goes; 200 is still best.
    mngr.save(400, _state(400), metrics={"loss": LOSSES[400]})
    mngr.wait_until_finished()
    assert mngr.all_steps() == [400, 500]  # Saved last, yet not the newest.
  assert finalized_steps_on_disk(tmp_path) == [400, 500]


def test_the_callback_keeps_the_best_accuracy(tmp_path):
  accuracy = {2: 0.50, 4: 0.91, 6: 0.70, 8: 0.95, 10: 0.60, 12: 0.65}
  with CheckpointCallback(
      tmp_path, every_steps=2, max_to_keep=1,
      retention=Retention(keep_best=2, best_metric="acc", best_mode="max"),
      tolerance=FaultTolerance(save_on_preemption=False)) as cb:
    for step in range(1, 13):
      cb(step, _state(step), metrics={"acc": accuracy.get(step, math.nan)})
  assert finalized_steps_on_disk(tmp_path) == [4, 8, 12]


def test_processes_with_other_metrics_follow_the_primary(tmp_path):
  """Each process passes its own loss; the primary's decides for all."""

  def work(coord):
    me = coord.process_index
    with CheckpointManager(
        tmp_path, max_to_keep=1,
        retention=Retention(keep_best=1, best_metric="loss"),
        processes=Processes(coordinator=coord, barrier_timeout_secs=30)) as mngr:
      for step in (1, 2, 3, 4):
        # Process 1 would rank the steps the other way round.
        loss = step if me == 0 else -step
        mngr.save(step, _state(step), metrics={"loss": loss})
        mngr.wait_until_finished()
      return mngr.all_steps()

  results = run_threads(2, work)
  assert results == [[1, 4], [1, 4]], results
  assert finalized_steps_on_disk(tmp_path) == [1, 4]


# -- flax-ckpt list, and the docs ----------------------------------------------


def _doc_blocks(page: str, start: str) -> tuple[str, str]:
  """The python block holding `start`, and the console block after it."""
  text = (REPO_ROOT / "docs" / page).read_text()
  i = text.index(start)
  code = text[text.rindex("```python\n", 0, i) + 10:text.index("```\n", i)]
  j = text.index("```console\n", i)
  console = text[j + 11:text.index("```\n", j)]
  return code, console


def _comparable(text: str) -> list[list[str]]:
  """The cells of `list`'s lines, with what differs from run to run (sizes,
  which hold a timestamp, ages, the writer) elided."""
  lines = []
  for line in text.splitlines():
    if line.startswith("last writer:"):
      line = re.sub(r"pid \d+ on \S+", "pid P on H", line)
      line = re.sub(r"at \S+$", "at T", line)
    line = re.sub(r"\d+s ago", "AGE", line)
    line = re.sub(r"\d+(\.\d+)? (B|KiB)", "SIZE", line)
    lines.append(re.split(r"\s{2,}", line.strip()))
  return lines


def test_retention_doc_example_and_the_list_it_shows(tmp_path, capsys,
                                                  monkeypatch):
  code, console = _doc_blocks("retention.md", "losses = {100")
  monkeypatch.chdir(tmp_path)
  exec(compile(code, "docs/retention.md", "exec"), {})  # pylint: disable=exec-used
  assert capsys.readouterr().out == "[200, 400, 600, 700]\n"

  command, _, expected = console.partition("\n")
  assert command == "$ flax-ckpt list best"
  assert cli.main(["list", "best"]) == 0
  out = capsys.readouterr().out
  assert _comparable(out) == _comparable(expected)
  # cli.md shows the same directory.
  _, cli_console = _doc_blocks("cli.md", "### Which rule keeps each step")
  assert cli_console == console

  assert cli.main(["list", "best", "--json"]) == 0
  listing = json.loads(capsys.readouterr().out)
  assert listing["retention"] == Policy(
      max_to_keep=2, keep_best=2, best_metric="loss",
      keep_without_metric=False).to_json()
  by_step = {e["step"]: e for e in listing["steps"]}
  assert by_step[200]["kept_by"] == ["best 2 by loss (min)"]
  assert by_step[200]["metrics"] == {"loss": 0.5}
  assert by_step[700]["metrics"] is None


def test_list_names_the_step_that_retention_is_about_to_delete(tmp_path,
                                                                 capsys):
  """The newest manifest's policy rules; a commit hook, which runs before
  retention, sees the step that no rule keeps any more."""
  with CheckpointManager(tmp_path) as mngr:  # Keeps all, records none.
    mngr.save(1, _state(1))
  assert cli.main(["list", os.fspath(tmp_path)]) == 0
  assert "KEPT BY" not in capsys.readouterr().out

  seen = []

  def hook(stats):
    assert cli.main(["list", os.fspath(tmp_path)]) == 0
    seen.append(capsys.readouterr().out.splitlines())

  with CheckpointManager(tmp_path, max_to_keep=1,
                         hooks=[hook]) as mngr:
    mngr.save(2, _state(2))
  rows = seen[0]
  assert rows[0].split()[-2:] == ["KEPT", "BY"]
  assert rows[1].endswith("none: retention deletes it")
  assert rows[2].endswith("newest, newest 1")
  assert finalized_steps_on_disk(tmp_path) == [2]


def test_list_names_the_time_rules_that_keep_each_step(tmp_path, capsys):
  with CheckpointManager(tmp_path, retention=Retention(
      max_to_keep=1, keep_every_secs=3600, keep_for_secs=86400)) as mngr:
    for step in (1, 2, 3):
      mngr.save(step, _state(step))
  assert cli.main(["list", os.fspath(tmp_path)]) == 0
  rows = capsys.readouterr().out.splitlines()
  assert rows[1].endswith("every 1h, younger than 1d")
  assert rows[2].endswith("younger than 1d")
  assert rows[3].endswith("newest, newest 1, younger than 1d")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_real_processes_keep_what_the_primary_ranks_best(tmp_path):
  out = [r.json for r in run_workers("best_n", 2, args=[tmp_path / "ckpt"],
                                     timeout=180)]
  assert out[0] == out[1]
  listed = out[0]["listed"]
  assert listed["2"] == [1, 2]
  assert listed["3"] == [2, 3]  # Process 1 alone would have kept 1.
  assert listed["4"] == [2, 4]
  assert listed["5"] == [2, 4, 5]
  assert listed["6"] == [2, 4, 6]
  assert finalized_steps_on_disk(tmp_path / "ckpt") == [2, 4, 6]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_real_processes_keep_by_the_primary_s_clock(tmp_path):
  out = [r.json for r in run_workers("time_rules", 2,
                                     args=[tmp_path / "ckpt"], timeout=180)]
  assert out[0] == out[1]
  listed = out[0]["listed"]
  assert listed["3"] == [1, 3]
  assert listed["4"] == [1, 4]  # 40 s after step 1, by the primary's clock.
  assert listed["6"] == [1, 4, 6]  # Process 1 alone would have kept [1, 6].
  assert finalized_steps_on_disk(tmp_path / "ckpt") == [1, 4, 6]


def test_retention_keeps_the_newest_step_known_to_restore():
  keep_one = Policy(max_to_keep=1)
  assert keep_one.to_delete([1, 6]) == [1]
  assert keep_one.to_delete([1, 6], protect=1) == []
  assert keep_one.to_delete([1, 6, 8], protect=6) == [1]
