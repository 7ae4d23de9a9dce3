"""Preemption: a notice saves the current step, stops, and a rerun resumes.

End to end, as a user runs the examples: SIGTERM at a random step makes
`examples/train.py` (one process) and `examples/multihost.py` (two processes,
the signal sent to one of them) save that step, exit with code 75, and resume
to the same bits as a run that was never interrupted. In process: a notice
during an in-flight commit, and the signal handlers themselves (chaining,
restoring, other signals, turned off).
"""

from __future__ import annotations

import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import PREEMPTED_EXIT_CODE
from flax_ckpt_plugin.save import writer
from flax_ckpt_plugin import FaultTolerance
from flax_ckpt_plugin import LocalBackend
from flax_ckpt_plugin import Storage

from helpers import start_thread
from launcher import StdoutLines

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = REPO_ROOT / "examples" / "train.py"
MULTIHOST = REPO_ROOT / "examples" / "multihost.py"

NUM_STEPS = 60
# Regular saves at 25 and 50 (and the last step): the step a notice lands on
# is usually not one of them, so the preemption save is what a rerun needs.
EVERY_STEPS = 25
# Signalled runs pace their steps, so that the run is still going when the
# signal arrives however loaded the machine is; the other runs go full speed.
STEP_SECS = "0.1"
# Generous: another test run may share the machine's two cores.
RUN_SECS = 300


def _env() -> dict[str, str]:
  env = dict(os.environ)
  # One CPU device per process as on a laptop (conftest set two for pytest);
  # the multihost launcher sets its own count.
  env.pop("XLA_FLAGS", None)
  # Block-buffered stdout, so each flushed print is one write and lines of
  # two processes sharing a pipe never interleave.
  env.pop("PYTHONUNBUFFERED", None)
  env["JAX_PLATFORMS"] = "cpu"
  return env


class Child:
  """A command in its own session whose stdout lines are watched as they come.

  Everything the command runs is killed (the whole process group) on exit
  from the `with` block, and every failure shows its stdout and stderr.
  """

  def __init__(self, argv: list[str], *, timeout: float = RUN_SECS):
    self.argv = argv
    self.timeout = timeout
    self._deadline = time.monotonic() + timeout
    self._stderr = tempfile.TemporaryFile()
    self.proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=self._stderr,
        stdin=subprocess.DEVNULL, env=_env(), cwd=REPO_ROOT, text=True,
        start_new_session=True)
    self._stderr_text: str | None = None  # Kept once the file is closed.
    self._stdout = StdoutLines(self.proc.stdout)

  @property
  def lines(self) -> list[str]:
    return self._stdout.lines

  def output(self) -> str:
    """The command line, its stdout and the tail of its stderr."""
    if self._stderr_text is None:
      self._stderr.seek(0)
      err = self._stderr.read().decode("utf-8", errors="replace")
    else:
      err = self._stderr_text
    out = "\n".join(self.lines)
    return (f"$ {' '.join(self.argv)}\n--- stdout ---\n{out}\n"
            f"--- stderr (tail) ---\n{err[-8000:]}")

  def kill(self) -> None:
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass  # Everything in the group already exited.
    self.proc.wait()

  def fail(self, message: str) -> None:
    self.kill()
    pytest.fail(f"{message}\n{self.output()}", pytrace=False)

  def wait_for_line(self, pattern: str) -> re.Match:
    """The first stdout line that fully matches `pattern`, waiting for it."""
    m = self._stdout.wait_match(pattern, self._deadline)
    if m:
      return m
    self.fail(f"no stdout line matching {pattern!r} (exit code"
              f" {self.proc.poll()})")

  def find_lines(self, pattern: str) -> list[re.Match]:
    """Every stdout line so far that fully matches `pattern`."""
    return [m for l in self.lines if (m := re.fullmatch(pattern, l))]

  def wait(self) -> int:
    """The exit code, once the command exited and its stdout is closed."""
    try:
      code = self.proc.wait(timeout=max(0.0,
                                        self._deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      self.fail(f"still running after {self.timeout:.0f}s; killed")
    if not self._stdout.wait_closed(
        max(1.0, self._deadline - time.monotonic())):
      self.fail("stdout still open after the command exited")
    return code

  def __enter__(self) -> "Child":
    return self

  def __exit__(self, *exc) -> None:
    self.kill()  # Never leave a process behind, whatever the test did.
    self._stderr.seek(0)
    self._stderr_text = self._stderr.read().decode("utf-8", errors="replace")
    self._stderr.close()


def run_to_end(argv: list[str]) -> Child:
  """Runs `argv` to exit code 0; returns it for its output."""
  with Child(argv) as child:
    code = child.wait()
    if code != 0:
      child.fail(f"exit code {code}, expected 0")
  return child


def load_npz(path: pathlib.Path) -> dict[str, np.ndarray]:
  with np.load(path) as npz:
    return {k: npz[k] for k in npz.files}


def assert_same_bits(actual_path: pathlib.Path,
                     expected_path: pathlib.Path) -> None:
  """Every leaf (params, optimizer state, step) has the same dtype and bytes."""
  actual, expected = load_npz(actual_path), load_npz(expected_path)
  assert sorted(actual) == sorted(expected)
  assert any("mu" in k for k in expected), sorted(expected)  # Adam's state.
  for k, v in expected.items():
    assert (actual[k].dtype, actual[k].shape) == (v.dtype, v.shape), k
    assert actual[k].tobytes() == v.tobytes(), f"{k} differs after resume"
  assert int(actual[".step"]) == NUM_STEPS


def loss_lines(child: Child, after: int = 0) -> list[str]:
  return [m[0] for m in child.find_lines(r"step (\d+): loss \S+")
          if int(m[1]) > after]


def expected_steps(preempted: int, max_to_keep: int) -> list[int]:
  """Finalized steps after a stop at `preempted`: regular saves, then it."""
  regular = range(EVERY_STEPS, preempted + 1, EVERY_STEPS)
  return sorted(set(regular) | {preempted})[-max_to_keep:]


def step_entries(directory: pathlib.Path) -> list[str]:
  """Names of the step entries in a checkpoint directory, finalized or not.

  `<step>`, `<step>.partial`, `<step>.deleting` (docs/format.md); other
  files the library keeps there are not steps.
  """
  return sorted(n for n in os.listdir(directory)
                if n.split(".")[0].isdigit())


def signal_step(seed: str) -> int:
  """A random step to signal after, whose next step is no regular save."""
  rng = random.Random(seed)
  return rng.choice([s for s in range(10, 41) if (s + 1) % EVERY_STEPS])


# -- one process: examples/train.py ------------------------------------------


def train_argv(workdir: pathlib.Path, *extra: str) -> list[str]:
  return [sys.executable, os.fspath(TRAIN), "--workdir", os.fspath(workdir),
          "--num-steps", str(NUM_STEPS), "--every-steps", str(EVERY_STEPS),
          "--log-every", "1", *extra]


@pytest.fixture(scope="module")
def train_reference(tmp_path_factory) -> tuple[Child, pathlib.Path]:
  """examples/train.py run to the end without interruption."""
  tmp = tmp_path_factory.mktemp("train_reference")
  final = tmp / "final.npz"
  child = run_to_end(train_argv(tmp / "workdir", "--final-params",
                                os.fspath(final)))
  return child, final


@pytest.mark.timeout(1200)
@pytest.mark.multiprocess
def test_sigterm_at_random_step_saves_exits_75_and_resumes_exactly(
    tmp_path, request, train_reference):
  after = signal_step(request.node.name)
  reference, reference_npz = train_reference

  workdir = tmp_path / "preempted"
  with Child(train_argv(workdir, "--step-secs", STEP_SECS)) as child:
    child.wait_for_line(rf"step {after}: loss \S+")
    os.kill(child.proc.pid, signal.SIGTERM)
    code = child.wait()
    stops = child.find_lines(
        r"preempted: checkpoint of step (\d+) is durable, exiting with code"
        r" (\d+)")
    if code != PREEMPTED_EXIT_CODE or len(stops) != 1:
      child.fail(f"SIGTERM after step {after}: exit code {code}, expected"
                 f" {PREEMPTED_EXIT_CODE} after one preemption line")
  step = int(stops[0][1])
  assert int(stops[0][2]) == PREEMPTED_EXIT_CODE
  assert after < step < NUM_STEPS, child.output()
  # It trained no step past the one it saved, and did not finish.
  assert loss_lines(child)[-1].startswith(f"step {step}:")
  assert not child.find_lines(r"done at step .*")
  # The reported step is finalized and the newest; nothing unfinished is left.
  expected = expected_steps(step, max_to_keep=3)
  reader = CheckpointManager(workdir, read_only=True)
  assert reader.all_steps() == expected
  assert step_entries(workdir) == sorted(str(s) for s in expected)
  # The data position saved with it: `step` batches of 32 per epoch consumed.
  position = reader.metadata(step).extra
  assert position["epoch"] * 32 + position["batch"] == step, position

  resumed = run_to_end(train_argv(
      workdir, "--final-params", os.fspath(tmp_path / "resumed.npz")))
  assert resumed.lines[0] == f"restored step {step}"
  assert resumed.lines[-1] == f"done at step {NUM_STEPS}"
  # Same batches, same losses, same final parameters and optimizer state.
  assert loss_lines(resumed) == loss_lines(reference, after=step)
  assert_same_bits(tmp_path / "resumed.npz", reference_npz)


# -- two processes: examples/multihost.py --launch 2 -------------------------


def multihost_argv(workdir: pathlib.Path, *extra: str) -> list[str]:
  return [sys.executable, os.fspath(MULTIHOST), "--launch", "2",
          "--workdir", os.fspath(workdir), "--num-steps", str(NUM_STEPS),
          "--every-steps", str(EVERY_STEPS), "--log-every", "1", *extra]


@pytest.fixture(scope="module")
def multihost_reference(tmp_path_factory) -> pathlib.Path:
  """The final state of examples/multihost.py run without interruption."""
  tmp = tmp_path_factory.mktemp("multihost_reference")
  final = tmp / "final.npz"
  run_to_end(multihost_argv(tmp / "workdir", "--final-params",
                            os.fspath(final)))
  return final


# The signalled process is the primary host (0), which finalizes, or the
# other one (1); either way its peer learns of the notice only through JAX.
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("target", [0, 1])
@pytest.mark.multiprocess
def test_sigterm_to_one_of_two_processes_stops_both_at_one_step(
    tmp_path, request, multihost_reference, target):
  after = signal_step(request.node.name)

  workdir = tmp_path / "preempted"
  with Child(multihost_argv(workdir, "--step-secs", STEP_SECS)) as child:
    pid = int(child.wait_for_line(rf"process {target}: pid (\d+)")[1])
    child.wait_for_line(rf"step {after}: loss \S+")
    os.kill(pid, signal.SIGTERM)  # This process alone.
    code = child.wait()
    stops = child.find_lines(
        r"process (\d): preempted: checkpoint of step (\d+) is durable,"
        r" exiting with code 75")
    exits = child.find_lines(r"process (\d) exited with code (-?\d+)")
    if code != PREEMPTED_EXIT_CODE or len(stops) != 2:
      child.fail(f"SIGTERM to process {target} after step {after}: launcher"
                 f" exit code {code}, expected {PREEMPTED_EXIT_CODE} after"
                 " both processes printed a preemption line")
  # Both processes saved the same step and exited with 75.
  assert sorted(int(m[1]) for m in stops) == [0, 1]
  assert len({m[2] for m in stops}) == 1, [m[0] for m in stops]
  assert sorted((m[1], m[2]) for m in exits) == [("0", "75"), ("1", "75")]
  step = int(stops[0][2])
  assert after < step < NUM_STEPS, child.output()
  assert loss_lines(child)[-1].startswith(f"step {step}:")
  # One finalized directory for that step, with the data of both processes.
  expected = expected_steps(step, max_to_keep=2)
  reader = CheckpointManager(workdir, read_only=True)
  assert reader.all_steps() == expected
  assert step_entries(workdir) == sorted(str(s) for s in expected)
  assert reader.metadata(step).process_count == 2
  assert sorted(os.listdir(workdir / str(step) / "data")) == [
      "process_00000.bin", "process_00001.bin"]

  resumed = run_to_end(multihost_argv(
      workdir, "--final-params", os.fspath(tmp_path / "resumed.npz")))
  assert resumed.find_lines(rf".*; restored step {step}"), resumed.output()
  assert sorted(m[0] for m in resumed.find_lines(
      r"process \d exited with code 0")) == [
          "process 0 exited with code 0", "process 1 exited with code 0"]
  assert_same_bits(tmp_path / "resumed.npz", multihost_reference)


# -- in process: the callback's own signal handlers ----------------------------


@pytest.fixture
def previous_handlers():
  """Python handlers for SIGTERM and SIGUSR1 that record what they receive.

  They are the handlers installed before the callback (which must chain to
  them), and they keep a signal that the callback failed to catch from
  killing pytest. The original handlers come back after the test.
  """
  received: list[signal.Signals] = []

  def record(signum, frame):
    del frame
    received.append(signal.Signals(signum))

  originals = {s: signal.signal(s, record)
               for s in (signal.SIGTERM, signal.SIGUSR1)}
  try:
    yield record, received
  finally:
    for s, handler in originals.items():
      signal.signal(s, handler)


def _tiny(step: int) -> dict[str, np.ndarray]:
  return {"w": np.full((3, 2), step, np.float32)}


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict]:
  """Starts `fn` in a thread; its result or exception lands in the dict."""
  return start_thread(fn, name="train-loop", daemon=False)


@pytest.mark.timeout(300)
def test_sigterm_during_inflight_commit_saves_next_step_after_it(
    ckpt_dir, make_state, train_step, host_copy, assert_trees_equal,
    monkeypatch, previous_handlers):
  """Fault injected: the background write of step 4 is held open until the
  test releases it, as on a slow disk."""
  _, received = previous_handlers
  writing, release = threading.Event(), threading.Event()
  real_write = writer.write_process_files

  def held_write(step_dir, leaves, process_index, **kwargs):
    # `step_dir` is "<step>.partial" (rename mode) or "<step>".
    if step_dir.name.split(".")[0] == "4":
      writing.set()
      if not release.wait(timeout=RUN_SECS):
        raise TimeoutError("the test never released the write of step 4")
    return real_write(step_dir, leaves, process_index, **kwargs)

  monkeypatch.setattr(writer, "write_process_files", held_write)
  cb = CheckpointCallback(ckpt_dir, every_steps=4, max_to_keep=None)
  try:
    expected = {}
    state = make_state()
    for step in range(1, 5):
      state = train_step(state)
      expected[step] = host_copy(state)
      assert cb(step, state) == (step == 4)
    assert writing.wait(timeout=RUN_SECS), "the write of step 4 never began"

    os.kill(os.getpid(), signal.SIGTERM)
    assert received == [signal.SIGTERM]  # Caught; the old handler ran too.
    state = train_step(state)
    expected[5] = host_copy(state)
    thread, out = _in_thread(lambda: cb(5, state))
    # The notice must wait for the commit of step 4: a bounded look for a
    # return that must not happen.
    thread.join(timeout=2.0)
    assert thread.is_alive(), f"returned while step 4 was held: {out}"
    assert cb.manager.all_steps() == []
    assert not cb.should_stop

    release.set()
    thread.join(timeout=RUN_SECS)
    assert not thread.is_alive(), "still saving after the write was released"
    if "error" in out:
      raise out["error"]
    assert out["result"] is True
    assert cb.should_stop
    # Both steps are finalized by the time should_stop is set.
    assert cb.manager.all_steps() == [4, 5]
    assert step_entries(ckpt_dir) == ["4", "5"]  # Nothing unfinished.
    assert not cb(6, state)  # Stopped: nothing more is saved.
    target = train_step(make_state(seed=9))
    for step in (4, 5):
      assert_trees_equal(cb.manager.restore(target, step), expected[step])
  finally:
    release.set()
    cb.close()  # Puts SIGTERM's previous handler back, even on failure.
  assert signal.getsignal(signal.SIGTERM) is previous_handlers[0]


def test_previous_handler_still_runs(ckpt_dir, previous_handlers):
  _, received = previous_handlers
  cb = CheckpointCallback(ckpt_dir, every_steps=100)
  try:
    assert not cb(1, _tiny(1))
    os.kill(os.getpid(), signal.SIGTERM)
    assert received == [signal.SIGTERM]
    assert cb(2, _tiny(2))
    assert cb.should_stop
    assert cb.manager.all_steps() == [2]
  finally:
    cb.close()


def test_close_restores_previous_handlers(ckpt_dir, previous_handlers):
  record, received = previous_handlers
  cb = CheckpointCallback(
      ckpt_dir,
      tolerance=FaultTolerance(
          preemption_signals=(signal.SIGTERM, signal.SIGUSR1)))
  try:
    assert signal.getsignal(signal.SIGTERM) is not record
    assert signal.getsignal(signal.SIGUSR1) is not record
  finally:
    cb.close()
  assert signal.getsignal(signal.SIGTERM) is record
  assert signal.getsignal(signal.SIGUSR1) is record

  with CheckpointCallback(ckpt_dir) as cb:
    assert signal.getsignal(signal.SIGTERM) is not record
  assert signal.getsignal(signal.SIGTERM) is record
  # After close a signal reaches only the old handler; nothing is saved.
  os.kill(os.getpid(), signal.SIGTERM)
  assert received == [signal.SIGTERM]
  assert not cb.should_stop
  assert step_entries(ckpt_dir) == []


def test_other_signal_configured_saves_and_stops(ckpt_dir, previous_handlers):
  """SLURM's `--signal=USR1@90`: SIGUSR1 is the notice, SIGTERM is not."""
  _, received = previous_handlers
  cb = CheckpointCallback(
      ckpt_dir, every_steps=100,
      tolerance=FaultTolerance(preemption_signals=(signal.SIGUSR1,)))
  try:
    os.kill(os.getpid(), signal.SIGTERM)
    assert not cb(1, _tiny(1))
    assert not cb.should_stop
    os.kill(os.getpid(), signal.SIGUSR1)
    assert received == [signal.SIGTERM, signal.SIGUSR1]
    assert cb(2, _tiny(2))
    assert cb.should_stop
    assert not cb(3, _tiny(3))
    assert cb.manager.all_steps() == [2]
    restored = cb.manager.restore(_tiny(0), 2)
    assert restored["w"].tobytes() == _tiny(2)["w"].tobytes()
  finally:
    cb.close()


def test_a_preemption_stop_leaves_retention_s_deletes_to_close(
    ckpt_dir, previous_handlers):
  """The stop waits for the preemption step to be durable, not for the
  deletes of older steps. Fault injected: a slow store, as a backend whose
  background deletes wait at a gate (a disk deletes a small step at once)."""
  gate, at_gate, deleted = threading.Event(), threading.Event(), []

  class SlowDeletes(LocalBackend):

    def delete_step(self, directory, step):
      if threading.current_thread().name.startswith(
          "flax_ckpt_plugin-delete-"):
        at_gate.set()
        gate.wait(10)
      super().delete_step(directory, step)
      deleted.append(step)

  cb = CheckpointCallback(
      ckpt_dir, every_steps=1, max_to_keep=1,
      storage=Storage(backend=SlowDeletes()),
      tolerance=FaultTolerance(preemption_signals=(signal.SIGUSR1,)))
  try:
    assert cb(1, _tiny(1)) and cb(2, _tiny(2))  # Step 1's delete queued.
    os.kill(os.getpid(), signal.SIGUSR1)
    assert cb(3, _tiny(3))
    assert cb.should_stop
    assert at_gate.wait(10)
    assert deleted == []  # Still at the gate: the stop did not wait.
    assert cb.manager.all_steps() == [3]
  finally:
    gate.set()
    cb.close()  # Leaving: finishes step 1's delete, starts not step 2's.
  assert step_entries(ckpt_dir) == ["2", "3"]


def test_save_on_preemption_false_installs_nothing(ckpt_dir,
                                                   previous_handlers):
  record, received = previous_handlers
  cb = CheckpointCallback(
      ckpt_dir,
      tolerance=FaultTolerance(
          save_on_preemption=False,
          preemption_signals=(signal.SIGTERM, signal.SIGUSR1)))
  try:
    assert signal.getsignal(signal.SIGTERM) is record
    assert signal.getsignal(signal.SIGUSR1) is record
    os.kill(os.getpid(), signal.SIGTERM)
    assert received == [signal.SIGTERM]
    assert not cb(1, _tiny(1))
    assert not cb.should_stop
  finally:
    cb.close()
  assert step_entries(ckpt_dir) == []
