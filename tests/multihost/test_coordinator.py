"""Cross-process logic on the fake coordinator: N "processes" as threads.

The real multi-process tests (test_multihost*.py) run the same protocol over
JAX's coordination service; these cover its decisions in milliseconds.
"""

import threading
import time

import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointCorruptedError
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import CommitHookError
from flax_ckpt_plugin import RestoreFailedError
from flax_ckpt_plugin import SaveFailedError
from flax_ckpt_plugin.backends import registry as backend_lib
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.restore.directory_reader import DirectoryReader
from flax_ckpt_plugin import Processes
from flax_ckpt_plugin import Storage
from flax_ckpt_plugin import FaultTolerance
from flax_ckpt_plugin.loop import triggers
from fake_coordinator import FakeCluster
from fake_coordinator import run_threads

TIMEOUT_SECS = 20.0


def _state(step: int) -> dict:
  return {"w": np.full((4, 3), step, np.float32), "step": step}


# -- agree ---------------------------------------------------------------------


def test_agree_tells_every_process_who_failed():
  def work(coord):
    def fn():
      if coord.process_index == 2:
        raise OSError("disk on fire")
      return coord.process_index * 10
    return meetings.agree(meetings.Meeting(coord, "k", 10_000), fn)

  outcomes = run_threads(3, work)
  for i, outcome in enumerate(outcomes):
    assert outcome.failures == {2: ("OSError", "disk on fire")}
    assert (outcome.error is not None) == (i == 2)
  assert [o.result for o in outcomes] == [0, 10, None]


def test_agree_times_out_naming_the_key_when_a_process_never_comes():
  cluster = FakeCluster(2)
  coord = cluster.coordinators()[0]
  aborted = []
  with pytest.raises(TimeoutError, match="'lonely/done'"):
    meetings.agree(
        meetings.Meeting(coord, "lonely", 50),
        lambda: 1,
        on_timeout=lambda: aborted.append(True))
  assert aborted == [True]


def test_fresh_makes_a_reused_name_fresh():
  coord = FakeCluster(1).coordinators()[0]
  assert [keys.fresh(coord, "a"), keys.fresh(coord, "a"),
          keys.fresh(coord, "b")] == ["a/0", "a/1", "b/0"]


# -- managers over the fake coordinator -----------------------------------------


def test_three_processes_save_and_restore(tmp_path):
  def work(coord):
    with CheckpointManager(
        tmp_path,
        processes=Processes(coordinator=coord,
                            barrier_timeout_secs=TIMEOUT_SECS)) as mgr:
      mgr.save(1, _state(1))
      mgr.save(2, _state(2))
      mgr.wait_until_finished()
      step, restored = mgr.restore_newest_valid(_state(0))
      return mgr.name, step, restored

  results = run_threads(3, work)
  assert all(not isinstance(r, BaseException) for r in results), results
  names = {name for name, _, _ in results}
  assert len(names) == 1  # Every process derived the same keys.
  for _, step, restored in results:
    assert step == 2 and restored["step"] == 2
    np.testing.assert_array_equal(restored["w"], _state(2)["w"])


def test_a_manager_opened_on_one_process_only_shifts_no_later_keys(tmp_path):
  """Barrier names do not count the managers a process opened: a read-only
  manager opened on the primary alone (as in a commit hook) leaves the
  next writer's barriers the same on every process, and its save does not
  time out."""
  (tmp_path / "other").mkdir()

  def work(coord):
    if coord.process_index == 0:
      CheckpointManager(tmp_path / "other", read_only=True,
                        processes=Processes(coordinator=coord)).close()
    with CheckpointManager(
        tmp_path / "run",
        processes=Processes(coordinator=coord, barrier_timeout_secs=5)) as mgr:
      mgr.save(1, _state(1))
    return "ok"

  assert run_threads(2, work) == ["ok", "ok"]


def test_two_managers_of_one_directory_in_turn_use_fresh_keys(tmp_path):
  cluster = FakeCluster(2)

  def work(coord):
    names = []
    for step in (1, 2):
      with CheckpointManager(
          tmp_path,
          processes=Processes(coordinator=coord,
                              barrier_timeout_secs=TIMEOUT_SECS)) as mgr:
        mgr.save(step, _state(step))
        names.append(mgr.name)
    return names

  results = run_threads(2, work, cluster=cluster)
  assert results[0] == results[1]
  assert results[0][0] != results[0][1]
  saves = {k for _, k in cluster.barrier_keys if "/save" in k}
  assert all(results[0][0] in k or results[0][1] in k for k in saves)


def _error_of_wait(mgr: CheckpointManager) -> Exception | None:
  """What `wait_until_finished` raised (None if nothing); closes `mgr`."""
  try:
    mgr.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    return e
  finally:
    mgr.close()
  return None


class _FullDisk(backend_lib.LocalBackend):
  """A local disk on which every step write fails with ENOSPC."""

  def step_writer(self, step_dir, identity, data_dir):
    raise OSError(28, "No space left on device")


def test_a_write_failure_on_one_process_fails_the_save_on_all(tmp_path):
  """Fault injected: process 1's disk is full (its backend)."""

  def work(coord):
    mgr = CheckpointManager(
        tmp_path,
        storage=Storage(backend=_FullDisk() if coord.process_index == 1 else None),
        processes=Processes(coordinator=coord,
                            barrier_timeout_secs=TIMEOUT_SECS))
    mgr.save(1, _state(1))
    return _error_of_wait(mgr)

  t0 = time.monotonic()
  errors = run_threads(2, work)
  assert time.monotonic() - t0 < TIMEOUT_SECS  # No one waited for a timeout.
  assert isinstance(errors[1], OSError)
  assert isinstance(errors[0], SaveFailedError)
  assert "process 1: OSError" in str(errors[0])
  assert not list(tmp_path.glob("1*"))  # Nothing of the step is left.


def test_a_failed_commit_hook_is_raised_on_every_process(tmp_path):
  def hook(stats):
    raise ValueError(f"evaluation of step {stats.step} failed")

  def work(coord):
    mgr = CheckpointManager(
        tmp_path,
        processes=Processes(coordinator=coord,
                            barrier_timeout_secs=TIMEOUT_SECS),
        hooks=[hook])
    mgr.save(1, _state(1))
    with pytest.raises(CommitHookError, match="evaluation of step 1"):
      mgr.wait_until_finished()
    mgr.close()
    return mgr.all_steps()

  assert run_threads(2, work) == [[1], [1]]


def test_any_restore_error_on_one_process_reaches_all_at_once(tmp_path):
  """The fallback votes on every error, not only on damage: an error of
  another kind on one process (here a target it cannot restore into)
  reaches the others at once, rather than leaving them at the vote's
  barrier for the whole timeout."""
  with CheckpointManager(tmp_path) as mgr:
    mgr.save(1, _state(1))

  def work(coord):
    with CheckpointManager(
        tmp_path,
        processes=Processes(coordinator=coord,
                            barrier_timeout_secs=TIMEOUT_SECS)) as mgr:
      target = _state(0)
      if coord.process_index == 1:
        target = {"w": object(), "step": 0}  # Cannot be restored into.
      try:
        mgr.restore_newest_valid(target)
      except Exception as e:  # pylint: disable=broad-except
        return e
    return None

  t0 = time.monotonic()
  errors = run_threads(2, work)
  assert time.monotonic() - t0 < TIMEOUT_SECS / 2
  assert isinstance(errors[0], RestoreFailedError), errors
  assert "process 1" in str(errors[0])
  assert errors[1] is not None and not isinstance(errors[1],
                                                  RestoreFailedError)
  # A target error is no damage: the good step was not set aside.
  assert (tmp_path / "1").is_dir()


def test_damage_on_one_process_is_skipped_by_all(tmp_path, monkeypatch):
  """Fault injected: process 1 reads step 2's data as damaged."""
  with CheckpointManager(tmp_path) as mgr:
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
  real = DirectoryReader._restore  # What every restore of a manager runs.

  def restore(self, target, step, options, data_iterator):
    if self.coordinator.process_index == 1 and step == 2:
      raise CheckpointCorruptedError("checksum mismatch (injected)")
    return real(self, target, step, options, data_iterator)

  monkeypatch.setattr(DirectoryReader, "_restore", restore)

  def work(coord):
    with CheckpointManager(
        tmp_path,
        processes=Processes(coordinator=coord,
                            barrier_timeout_secs=TIMEOUT_SECS)) as mgr:
      step, restored = mgr.restore_newest_valid(_state(0))
      return step, restored["step"], mgr.all_steps()

  assert run_threads(2, work) == [(1, 1, [1]), (1, 1, [1])]
  assert (tmp_path / "2.damaged").is_dir()


# -- every_secs ----------------------------------------------------------------


class _Clock:

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _count_every_secs_asks(coord) -> list[int]:
  """Counts this process's asks of the `every_secs` decision, from now on:
  the primary's answers (set) or the other's reads (got)."""
  asks = [0]
  name = "kv_set" if coord.process_index == 0 else "kv_get"
  inner = getattr(coord, name)

  def counted(key, *args, **kwargs):
    if "/every_secs/" in key:
      asks[0] += 1
    return inner(key, *args, **kwargs)

  setattr(coord, name, counted)
  return asks


def test_every_secs_agrees_without_asking_at_every_step(tmp_path,
                                                         monkeypatch):
  """The non-primary processes ask the coordination service at a few steps
  per interval, not with a blocking call at every step, and all processes
  still save at the same steps."""
  steps = 400
  clocks = {}  # Each "process" (thread) has a clock of its own.
  monkeypatch.setattr(triggers, "monotonic",
                      lambda: clocks[threading.get_ident()]())

  def work(coord):
    clock = clocks[threading.get_ident()] = _Clock()
    # Hosts' clocks disagree: the primary decides for all.
    clock.now = 1000.0 * coord.process_index
    asks = _count_every_secs_asks(coord)
    cb = CheckpointCallback(
        tmp_path, every_secs=50, max_to_keep=None,
        tolerance=FaultTolerance(save_on_preemption=False),
        processes=Processes(coordinator=coord,
                            barrier_timeout_secs=TIMEOUT_SECS))
    saved = []
    for step in range(1, steps + 1):
      clock.now += 1.0  # One second per step.
      if cb(step, _state(step)):
        saved.append(step)
    cb.close()
    return saved, asks[0]

  (saved0, asks0), (saved1, asks1) = run_threads(2, work)
  assert saved0 == saved1
  assert len(saved0) == steps // 50
  # About log2(50) asks per interval of 50 steps, not 50.
  assert asks0 == asks1 <= 10 * len(saved0) < steps / 4


def test_a_retention_failure_on_the_primary_is_raised_on_every_process(
    tmp_path):
  """Fault injected: the primary's backend cannot delete an old step. Before,
  only the primary raised; the others went on to the next save's barriers
  and waited there for the whole timeout. The delete runs in the
  background: the retention of the next save raises its error, on all."""

  class Undeletable(backend_lib.LocalBackend):

    def delete_step(self, directory, step):
      raise OSError(f"cannot delete step {step} (injected)")

  def work(coord):
    backend = Undeletable() if coord.process_index == 0 else None
    mgr = CheckpointManager(
        tmp_path, max_to_keep=1,
        storage=Storage(backend=backend),
        processes=Processes(coordinator=coord,
                            barrier_timeout_secs=TIMEOUT_SECS))
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    mgr.wait_until_finished()  # The primary's delete of step 1 failed.
    mgr.save(3, _state(3))  # Its retention tells every process.
    return _error_of_wait(mgr)

  t0 = time.monotonic()
  errors = run_threads(2, work)
  assert time.monotonic() - t0 < TIMEOUT_SECS / 2
  assert isinstance(errors[0], OSError) and "injected" in str(errors[0])
  assert isinstance(errors[1], RuntimeError)
  assert "retention after step 3 failed" in str(errors[1])
  assert "process 0: OSError" in str(errors[1])
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "1", "2", "3", "_WRITER"]
