"""Crashes at any moment never lose or corrupt a finalized checkpoint.

The harness (`test_sigkill_anywhere_then_restart`) runs a real training
process, `tests/crash_worker.py`, that saves every step with `max_to_keep=2`
(so snapshots, writes, finalizes and retention deletions never stop), kills
it with SIGKILL, and starts the next one on the same directory; that restart
is the check of the crash before it. A share of the kills land at a random
time; the others at a targeted moment: the worker wraps one package function
(the snapshot, a data write half done, finalize before or after the marker or
the rename, retention after the rename to `<step>.deleting` or half way
through removing it) so that it sends itself a real SIGKILL right there.

Each restart must restore the newest finalized step (or start fresh if none
was ever finalized) bit for bit equal to the state recomputed for that step,
find every other finalized step intact too, never meet a
`CheckpointCorruptedError`, and leave no unfinished entry in the directory
once it opened it. The restored step never goes backwards, since a finalized
step stays until a newer one is finalized. A targeted kill also says which
step it hit, so the restart checks the expected outcome: a step killed
before it was final is gone, one killed after is restored.

Settings (environment):
  FLAX_CKPT_PLUGIN_CRASH_TRIALS: kills per run (default 20; 200 for a soak).
  FLAX_CKPT_PLUGIN_CRASH_TARGETED: share of targeted kills (default 0.5).
  FLAX_CKPT_PLUGIN_CRASH_SEED: seed of the trial plan (default 0).

Also here, in process: a retention crash mid-deletion leaves a
`<step>.deleting` that is never listed or restored and is removed at the next
open; and with `max_to_keep=1` a failing save never costs the only finalized
step.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.save import atomicity
from flax_ckpt_plugin.backends import registry as backend_lib
from flax_ckpt_plugin.format import files
from flax_ckpt_plugin.save import writer
from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import CheckpointNotFoundError
from flax_ckpt_plugin import Storage

from crash_worker import MOMENTS
from crash_worker import stale_entries
from launcher import StdoutLines

TESTS = pathlib.Path(__file__).resolve().parents[1]
WORKER = TESTS / "crash_worker.py"

TRIALS = int(os.environ.get("FLAX_CKPT_PLUGIN_CRASH_TRIALS", "20"))
TARGETED_SHARE = float(os.environ.get("FLAX_CKPT_PLUGIN_CRASH_TARGETED",
                                      "0.5"))
SEED = int(os.environ.get("FLAX_CKPT_PLUGIN_CRASH_SEED", "0"))
# Random kills land this long after the worker said it trains.
RUN_SECS = (0.3, 3.0)
# A quarter of the trials write in commit-file mode (the object-store
# protocol, here on a local disk): the same directory sees both protocols.
COMMIT_FILE_SHARE = 0.25
# Generous deadlines for one worker phase: the 2-core machine is shared.
PHASE_SECS = 180
# Moments after which the killed step is final (in commit-file mode the
# marker is the last thing written, so it is final there too).
_FINAL_AFTER = {"finalize_renamed"}
_FINAL_AFTER_COMMIT_FILE = {"finalize_marker", "finalize_renamed"}


@dataclasses.dataclass(frozen=True)
class Plan:
  """How trial `index` runs and ends."""
  index: int
  moment: str | None  # A key of MOMENTS, or None for a random-time kill.
  kill_on: int  # The occurrence of `moment` that is killed.
  run_secs: float  # Random kills: time from "TRAINING" to SIGKILL.
  atomicity: str

  def describe(self) -> str:
    how = (f"SIGKILL at {self.moment} #{self.kill_on}" if self.moment
           else f"SIGKILL after {self.run_secs:.2f}s")
    return f"trial {self.index} ({self.atomicity}): {how}"


def make_plans(trials: int, targeted_share: float, seed: int) -> list[Plan]:
  """The trial plan; every moment comes once before any comes twice."""
  rng = random.Random(seed)
  n_targeted = round(trials * targeted_share)
  moments: list[str] = []
  while len(moments) < n_targeted:
    block = sorted(MOMENTS)
    rng.shuffle(block)
    moments += block
  targeted = sorted(rng.sample(range(trials), n_targeted))
  chosen = dict(zip(targeted, moments))
  return [Plan(index=i, moment=chosen.get(i), kill_on=rng.randint(1, 3),
               run_secs=rng.uniform(*RUN_SECS),
               atomicity=("commit_file" if rng.random() < COMMIT_FILE_SHARE
                          else "rename"))
          for i in range(trials)]


def _env(plan: Plan | None) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith("CRASH_")}
  env["JAX_PLATFORMS"] = "cpu"
  # Two CPU devices, so every array is saved as two shards.
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  if plan is None:
    env["CRASH_REPORT_ONLY"] = "1"
  else:
    env["CRASH_ATOMICITY"] = plan.atomicity
    if plan.moment:
      env["CRASH_KILL_AT"] = plan.moment
      env["CRASH_KILL_ON"] = str(plan.kill_on)
  return env


class Worker:
  """`crash_worker.py` in its own process group, its stdout read as it comes.

  Everything it started is killed (the whole group) by `kill`, which every
  failure path calls; failures carry its stdout and the tail of its stderr.
  """

  def __init__(self, directory: pathlib.Path, plan: Plan | None):
    self._stderr = tempfile.TemporaryFile()
    self.proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(directory)],
        stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL,
        env=_env(plan), cwd=TESTS.parent, text=True, start_new_session=True)
    self._stdout = StdoutLines(self.proc.stdout)

  def output(self) -> str:
    self._stderr.seek(0)
    err = self._stderr.read().decode("utf-8", errors="replace")
    out = "\n".join(self._stdout.lines)
    return (f"--- worker stdout ---\n{out}\n--- worker stderr (tail) ---\n"
            f"{err[-6000:]}")

  def kill(self) -> None:
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass  # The group is gone already.
    self.proc.wait()

  def wait_for(self, pattern: str, timeout: float = PHASE_SECS) -> str | None:
    """The first stdout line fully matching `pattern`; None if it exited."""
    m = self._stdout.wait_match(pattern, time.monotonic() + timeout)
    if m:
      return m.group(0)
    if self._stdout.closed:
      return None
    raise TimeoutError(f"no line matching {pattern!r} in {timeout}s")

  def wait_exit(self, timeout: float = PHASE_SECS) -> int:
    self.proc.wait(timeout)
    self._stdout.wait_closed(timeout)
    return self.proc.returncode


def _listing(directory: pathlib.Path) -> str:
  if not directory.exists():
    return f"{directory}: does not exist"
  rows = []
  for name in sorted(os.listdir(directory)):
    path = directory / name
    inner = sorted(os.listdir(path)) if path.is_dir() else ""
    rows.append(f"  {name} {inner}")
  return f"{directory}:\n" + "\n".join(rows)


@dataclasses.dataclass
class Kill:
  """What the previous trial's crash did."""
  plan: Plan
  step: int | None  # The step a targeted kill hit.
  leftovers: list[str]  # Unfinished entries it left, seen before reopening.


def check_restart(report: dict[str, Any], kill: Kill | None,
                  previous_restored: int | None) -> list[str]:
  """What is wrong with a restart's report, given the crash before it."""
  problems = []
  finalized = report["finalized_after_open"]
  restored = report["restored_step"]
  if report["error"]:
    problems.append(f"restore raised {report['error']}")
  if not report["verified"]:
    problems.append(f"restored step {restored} differs from the expected"
                    f" state: {report.get('diffs')}")
  if report.get("other_steps_bad"):
    problems.append("finalized steps that do not restore to their expected"
                    f" state: {report['other_steps_bad']}")
  if report["stale_entries_after_open"]:
    problems.append("unfinished entries remain after the open:"
                    f" {report['stale_entries_after_open']}")
  newest = finalized[-1] if finalized else None
  if restored != newest:
    problems.append(f"restored step {restored}, but the newest finalized"
                    f" step is {newest} (finalized: {finalized})")
  if (restored if restored is not None else -1) < (
      previous_restored if previous_restored is not None else -1):
    problems.append(f"restored step {restored} is older than step"
                    f" {previous_restored} restored by the run before")
  if kill is None or kill.plan.moment is None:
    return problems
  # A targeted kill: check that it hit what it claims, and its outcome.
  moment, step = kill.plan.moment, kill.step
  final_after = (_FINAL_AFTER_COMMIT_FILE
                 if kill.plan.atomicity == "commit_file" else _FINAL_AFTER)
  if moment.startswith("retention"):
    if f"{step}{atomicity.DELETING_SUFFIX}" not in kill.leftovers:
      problems.append(f"a kill at {moment} of step {step} left no"
                      f" {step}.deleting: {kill.leftovers}")
    if step in finalized:
      problems.append(f"step {step}, killed half deleted, is still listed")
  elif moment in final_after:
    if restored != step:
      problems.append(f"step {step} was final when killed at {moment}, but"
                      f" step {restored} was restored")
  else:
    if step in finalized:
      problems.append(f"step {step}, killed at {moment} before it was final,"
                      " is listed as finalized")
    unfinished = (f"{step}{atomicity.TMP_SUFFIX}"
                  if kill.plan.atomicity == "rename" else str(step))
    if moment != "snapshot" and unfinished not in kill.leftovers:
      problems.append(f"a kill at {moment} of step {step} left no"
                      f" {unfinished}: {kill.leftovers}")
  return problems


def _stale(directory: pathlib.Path) -> list[str]:
  """Unfinished entries by the worker's rule; read before a worker opens."""
  return stale_entries(str(directory)) if directory.exists() else []


class Harness:
  """Runs the trials on one directory and keeps the tally."""

  def __init__(self, directory: pathlib.Path):
    self.directory = directory
    self.kill: Kill | None = None  # The crash the next restart checks.
    self.previous_restored: int | None = None
    self.problems: list[str] = []
    self.history: list[str] = []
    self.kills_at: collections.Counter[str] = collections.Counter()
    self.restores = 0  # Restarts after a crash.
    self.verified = 0  # ... that restored the newest step, bit for bit.
    self.corrupt = 0  # ... that met a damaged finalized step.
    self.left_unfinished = 0  # Crashes that left unfinished entries.

  def fail(self, message: str, worker: Worker) -> None:
    worker.kill()
    pytest.fail(f"{message}\n{worker.output()}\n{_listing(self.directory)}\n"
                "trials so far:\n" + "\n".join(self.history), pytrace=False)

  def trial(self, plan: Plan | None) -> None:
    """Starts a worker, checks its restore, and kills it as `plan` says.

    `plan=None` only checks the restore (after the last crash).
    """
    leftovers = _stale(self.directory)
    if self.kill is not None:
      self.kill.leftovers = leftovers
      self.left_unfinished += bool(leftovers)
    worker = Worker(self.directory, plan)
    try:
      self._check_report(worker, plan, leftovers)
      if plan is None:
        if worker.wait_exit() != 0:
          self.fail("final restart: the worker failed", worker)
        return
      if worker.wait_for("TRAINING") is None:
        self.fail(f"{plan.describe()}: the worker exited"
                  f" ({worker.wait_exit()}) instead of training", worker)
      step = None
      if plan.moment:
        step = self._await_targeted_kill(worker, plan)
        self.history[-1] += f"; killed at {plan.moment} of step {step}"
      else:
        time.sleep(plan.run_secs)  # The deliberate random run time.
        if worker.proc.poll() is not None:
          self.fail(f"{plan.describe()}: the worker exited"
                    f" ({worker.proc.returncode}) before its kill", worker)
        worker.kill()
        self.history[-1] += "; killed at a random time"
      self.kills_at[plan.moment or "random"] += 1
      self.kill = Kill(plan, step, leftovers=[])  # Read at the next start.
    finally:
      worker.kill()

  def _check_report(self, worker: Worker, plan: Plan | None,
                    leftovers: list[str]) -> None:
    where = plan.describe() if plan else "final restart"
    try:
      line = worker.wait_for(r"\{.*\}")
    except TimeoutError as e:
      self.fail(f"{where}: {e}", worker)
    if line is None:
      self.fail(f"{where}: the worker exited ({worker.wait_exit()}) before"
                " reporting its restore", worker)
    report = json.loads(line)
    found = check_restart(report, self.kill, self.previous_restored)
    finalized = report["finalized_after_open"]
    if self.kill is not None:
      self.restores += 1
      self.verified += bool(report["verified"] and report["restored_step"] == (
          finalized[-1] if finalized else None))
      self.corrupt += bool(report["error"] or report.get("other_steps_bad"))
    self.history.append(
        f"{where}: restored {report['restored_step']}, finalized {finalized},"
        f" unfinished before the open {leftovers}")
    if found:
      kill = self.kill
      self.problems.append(
          f"{where}, after {kill.plan.describe() if kill else 'nothing'}"
          f" (killed step {kill.step if kill else None}):\n  "
          + "\n  ".join(found) + f"\n{worker.output()}")
    self.previous_restored = report["restored_step"]

  def _await_targeted_kill(self, worker: Worker, plan: Plan) -> int:
    """The step that the worker's targeted SIGKILL hit."""
    try:
      rc = worker.wait_exit()
    except subprocess.TimeoutExpired:
      self.fail(f"{plan.describe()}: the targeted kill never came", worker)
    line = worker.wait_for(r"\{\"killed_at\".*\}", timeout=0)
    if rc != -signal.SIGKILL or line is None:
      self.fail(f"{plan.describe()}: the worker ended with {rc} without a"
                " targeted kill", worker)
    return json.loads(line)["step"]

  def summary(self, trials: int, secs: float) -> str:
    families = collections.Counter()
    for moment, n in self.kills_at.items():
      families[moment.split("_")[0]] += n
    detail = ", ".join(f"{m}={self.kills_at[m]}" for m in sorted(MOMENTS))
    return (
        f"crash harness: {trials} trials, {self.verified}/{self.restores}"
        f" restores verified, {self.corrupt} corrupt restores, targeted"
        f" kills: snapshot={families['snapshot']} write={families['write']}"
        f" finalize={families['finalize']}"
        f" retention={families['retention']} ({detail}), random"
        f" kills={self.kills_at['random']}; {self.left_unfinished} crashes"
        f" left unfinished entries; newest restored step"
        f" {self.previous_restored}; {secs:.0f}s")


@pytest.mark.timeout(300 + 40 * TRIALS)
@pytest.mark.multiprocess
def test_sigkill_anywhere_then_restart(tmp_path, capsys):
  t0 = time.monotonic()
  harness = Harness(tmp_path / "ckpt")
  for plan in make_plans(TRIALS, TARGETED_SHARE, SEED):
    harness.trial(plan)
  harness.trial(None)  # Checks the last crash.
  summary = harness.summary(TRIALS, time.monotonic() - t0)
  with capsys.disabled():  # Shown without -s too.
    print(f"\n{summary}")
  assert not harness.problems, (
      f"{len(harness.problems)} of {TRIALS} restarts went wrong ({summary}):"
      "\n\n" + "\n\n".join(harness.problems[:5]))
  assert harness.corrupt == 0, summary
  assert harness.verified == harness.restores == TRIALS, summary
  if round(TRIALS * TARGETED_SHARE) >= len(MOMENTS):
    missed = sorted(set(MOMENTS) - set(harness.kills_at))
    assert not missed, f"targeted moments never hit: {missed} ({summary})"


def test_make_plans_covers_every_moment_in_the_ci_configuration():
  plans = make_plans(20, 0.5, 0)
  assert sum(p.moment is not None for p in plans) == 10
  assert {p.moment for p in plans} - {None} == set(MOMENTS)
  assert make_plans(20, 0.5, 0) == plans  # The same seed, the same trials.


# -- retention crashes and failed saves, in process ------------------------


def _save_steps(directory, steps, make_state, train_step, host_copy,
                **kwargs) -> dict[int, Any]:
  """Saves `steps` one after another; returns host copies of what was saved."""
  saved = {}
  state = make_state()
  with CheckpointManager(directory, **kwargs) as mgr:
    for step in steps:
      state = train_step(state)
      mgr.save(step, state)
      saved[step] = host_copy(state)
      mgr.wait_until_finished()
  return saved


@pytest.mark.parametrize("removed", [
    [],
    [files.data_file(0)],
    [files.data_file(0), files.MANIFEST],
], ids=["nothing_removed", "data_removed", "data_and_manifest_removed"])
def test_half_deleted_step_is_never_listed_and_is_removed_on_open(
    ckpt_dir, make_state, train_step, host_copy, assert_trees_equal,
    removed):
  saved = _save_steps(ckpt_dir, [1, 2, 3], make_state, train_step, host_copy,
                      max_to_keep=2)
  assert sorted(directory_lib.finalized_steps(ckpt_dir)) == [2, 3]
  # Retention crashed mid-deletion of step 2: renamed, some files gone, its
  # commit marker still inside.
  doomed = ckpt_dir / f"2{atomicity.DELETING_SUFFIX}"
  os.rename(ckpt_dir / "2", doomed)
  for name in removed:
    os.remove(doomed / name)
  assert (doomed / atomicity.COMMIT_MARKER).exists()
  target = train_step(make_state(seed=9))

  reader = CheckpointManager(ckpt_dir, read_only=True)
  assert reader.all_steps() == [3]
  assert reader.latest_step() == 3
  with pytest.raises(CheckpointNotFoundError, match="step 2 is not a"):
    reader.restore(target, step=2)
  assert_trees_equal(reader.restore(target), saved[3])
  assert doomed.exists()  # A reader never removes what a writer may own.

  callback = CheckpointCallback(ckpt_dir, every_steps=1, max_to_keep=2)
  assert sorted(os.listdir(ckpt_dir)) == ["3", atomicity.WRITER_FILE]
  assert callback.manager.all_steps() == [3]
  assert_trees_equal(callback.restore_or_initialize(target), saved[3])
  assert callback.restored_step == 3
  callback.close()


def _fail_write(step_dir, leaves, process_index, **kwargs):
  del leaves, process_index
  raise OSError(f"injected: disk full while writing {step_dir}")


def _fail_manifest(step_dir, **kwargs):
  del kwargs
  raise OSError(f"injected: disk full while writing the manifest of"
                f" {step_dir}")


_write_small = backend_lib.LocalBackend.write_small


def _fail_marker(self, path, text):
  if path.name == atomicity.COMMIT_MARKER:
    raise OSError(f"injected: disk full while writing {path}")
  _write_small(self, path, text)


@pytest.mark.parametrize("atomicity_mode", ["rename", "commit_file"])
@pytest.mark.parametrize("patch", [
    (writer, "write_process_files", _fail_write),
    (writer, "write_manifest", _fail_manifest),
    (backend_lib.LocalBackend, "write_small", _fail_marker),
], ids=["write", "manifest", "marker"])
def test_only_step_survives_a_failing_newer_save_with_max_to_keep_1(
    ckpt_dir, make_state, train_step, host_copy, assert_trees_equal,
    monkeypatch, atomicity_mode, patch):
  saved = _save_steps(ckpt_dir, [1], make_state, train_step, host_copy,
                      max_to_keep=1, storage=Storage(atomicity=atomicity_mode))
  target = train_step(make_state(seed=9))
  mgr = CheckpointManager(ckpt_dir, max_to_keep=1,
                          storage=Storage(atomicity=atomicity_mode))
  with monkeypatch.context() as m:
    m.setattr(*patch)
    mgr.save(2, train_step(make_state(seed=3)))
    with pytest.raises(OSError, match="injected: disk full"):
      mgr.wait_until_finished()
  assert mgr.all_steps() == [1]
  assert sorted(os.listdir(ckpt_dir)) == ["1", atomicity.WRITER_FILE]
  assert_trees_equal(mgr.restore(target), saved[1])
  mgr.close()

  # A restarted job still finds step 1, and only a good save of a newer
  # step lets retention remove it.
  callback = CheckpointCallback(ckpt_dir, every_steps=1, max_to_keep=1,
                                storage=Storage(atomicity=atomicity_mode))
  assert_trees_equal(callback.restore_or_initialize(target), saved[1])
  state = train_step(make_state(seed=4))
  expected = host_copy(state)
  assert callback(2, state)
  callback.close()
  assert sorted(os.listdir(ckpt_dir)) == ["2", atomicity.WRITER_FILE]
  assert_trees_equal(CheckpointManager(ckpt_dir, read_only=True).restore(
      target), expected)
