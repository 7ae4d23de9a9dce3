"""Tests of CheckpointCallback: triggers, restarts, restore, errors."""

import logging
import os

import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import Processes
from flax_ckpt_plugin import Storage
from flax_ckpt_plugin import FaultTolerance
from flax_ckpt_plugin.loop import triggers
from fake_coordinator import FakeCluster
from fake_coordinator import ThreadCoordinator

from helpers import adam_train_state as _train_state
from helpers import FlakyDisk
from helpers import join_commit
from helpers import sorted_entries
from helpers import tiny

TIMEOUT = 60


class FakeClock:
  """Seconds that move only when the test says so."""

  def __init__(self):
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


def _run(callback: CheckpointCallback, steps) -> list[int]:
  """Calls the callback at each step; returns the steps where it saved."""
  saved = [step for step in steps if callback(step, tiny(step))]
  callback.close()
  return saved


@pytest.mark.parametrize("kwargs, saved", [
    ({"every_steps": 3}, [3, 6, 9]),
    ({"on_steps": [0, 4, 7]}, [0, 4, 7]),
    ({"last_step": 5}, [5]),
    ({"every_steps": 4, "on_steps": [6], "last_step": 9}, [4, 6, 8, 9]),
    ({}, []),
], ids=["every_steps", "on_steps", "last_step", "combined", "none"])
def test_step_triggers(ckpt_dir, kwargs, saved):
  callback = CheckpointCallback(ckpt_dir, max_to_keep=None, **kwargs)
  assert _run(callback, range(10)) == saved
  assert callback.manager.all_steps() == saved
  assert sorted(sorted_entries(ckpt_dir), key=int) == [str(s) for s in saved]


def test_every_secs_with_fake_clock(ckpt_dir, monkeypatch):
  clock = FakeClock()
  monkeypatch.setattr(triggers, "monotonic", clock)
  callback = CheckpointCallback(ckpt_dir, every_secs=10.0, max_to_keep=None)
  start = clock.now
  saved = []
  for step, elapsed in [(1, 5.0), (2, 10.0), (3, 15.0), (4, 19.9),
                        (5, 20.0), (6, 100.0), (7, 100.0)]:
    clock.now = start + elapsed
    if callback(step, tiny(step)):
      saved.append(step)
  callback.close()
  # Counted from construction, then from the time of the last save.
  assert saved == [2, 5, 6]
  assert callback.manager.all_steps() == [2, 5, 6]


def test_never_resaves_a_finalized_step(ckpt_dir, assert_trees_equal):
  with CheckpointCallback(ckpt_dir, every_steps=5) as first:
    assert first(5, tiny(5))
  step_dir = ckpt_dir / "5"
  before = (os.stat(step_dir), os.stat(step_dir / "manifest.json"))

  # A restarted job calls its new callback at the step it resumed from.
  restarted = CheckpointCallback(ckpt_dir, every_steps=5)
  assert not restarted(5, tiny(55))
  assert not restarted.manager.save_in_progress
  restarted.close()
  after = (os.stat(step_dir), os.stat(step_dir / "manifest.json"))
  for b, a in zip(before, after):
    assert (a.st_ino, a.st_mtime_ns) == (b.st_ino, b.st_mtime_ns)
  assert_trees_equal(CheckpointManager(ckpt_dir).restore(tiny(0)),
                     {"w": np.full((3,), 5, np.int32)})


def test_restore_or_initialize_on_empty_directory(ckpt_dir, make_state):
  callback = CheckpointCallback(ckpt_dir, every_steps=1)
  state = make_state()
  assert callback.restore_or_initialize(state) is state
  assert callback.restored_step is None
  assert callback.restored_extra is None
  callback.close()


def test_restore_or_initialize_restores_newest(ckpt_dir, make_state,
                                               train_step, assert_trees_equal,
                                               host_copy):
  state = train_step(make_state())
  expected = {}
  with CheckpointCallback(ckpt_dir, on_steps=[2, 4]) as callback:
    for step in range(1, 5):
      expected[step] = host_copy(state)
      callback(step, state, extra={"data_position": step * 32})
      state = train_step(state)

  restarted = CheckpointCallback(ckpt_dir, on_steps=[2, 4])
  target = train_step(make_state(seed=9))
  restored = restarted.restore_or_initialize(target)
  assert type(restored) is type(target)
  assert restored.apply_fn is target.apply_fn
  assert restarted.restored_step == 4
  assert restarted.restored_extra == {"data_position": 128}
  assert_trees_equal(restored, expected[4])
  restarted.close()


def test_should_stop_stays_false_without_preemption(ckpt_dir):
  callback = CheckpointCallback(ckpt_dir, every_steps=2)
  for step in range(1, 7):
    callback(step, tiny(step))
    assert not callback.should_stop
  callback.close()
  assert not callback.should_stop


def _preempted_at(step: int) -> ThreadCoordinator:
  cluster = FakeCluster(1)
  cluster.preempt_at = step
  return cluster.coordinators()[0]


def test_preemption_sync_point_saves_and_stops(ckpt_dir):
  """Fault injected: the coordinator reports the preemption sync point at
  step 7 (a single process has no preemption sync manager)."""
  callback = CheckpointCallback(ckpt_dir, every_steps=5,
                                processes=Processes(coordinator=_preempted_at(7)))
  assert [s for s in range(1, 7) if callback(s, tiny(s))] == [5]
  assert not callback.should_stop
  assert callback(7, tiny(7))
  # Stop only once the preemption checkpoint is durable.
  assert callback.should_stop
  assert not callback.manager.save_in_progress
  assert callback.manager.all_steps() == [5, 7]
  assert not callback(8, tiny(8))  # Nothing more after the stop.
  callback.close()
  assert sorted_entries(ckpt_dir) == ["5", "7"]


def test_preemption_at_an_already_saved_step_stops_without_saving(
    ckpt_dir):
  """Fault injected: the preemption sync point is reported at step 5, which a
  previous run already saved."""
  with CheckpointCallback(ckpt_dir, every_steps=5) as first:
    first(5, tiny(5))
  restarted = CheckpointCallback(ckpt_dir, every_steps=5,
                                 processes=Processes(coordinator=_preempted_at(5)))
  assert not restarted(5, tiny(55))
  assert restarted.should_stop
  restarted.close()


def test_preemption_ignored_when_disabled(ckpt_dir):
  """Fault injected: the preemption sync point is reported at step 3."""
  coord = _preempted_at(3)
  callback = CheckpointCallback(
      ckpt_dir, tolerance=FaultTolerance(save_on_preemption=False),
      processes=Processes(coordinator=coord))
  assert not callback(3, tiny(3))
  assert not callback.should_stop
  callback.close()
  assert sorted_entries(ckpt_dir) == []


def test_background_error_surfaces_from_next_call(ckpt_dir):
  """Fault injected: the storage backend's writes fail for step 1."""
  disk = FlakyDisk(on_fire=True)
  callback = CheckpointCallback(ckpt_dir, on_steps=[1, 3],
                                storage=Storage(backend=disk))
  assert callback(1, tiny(1))  # The save started; it fails in background.
  join_commit(callback.manager, TIMEOUT)
  disk.on_fire = False

  with pytest.raises(OSError, match="disk on fire") as excinfo:
    callback(2, tiny(2))  # Not a save step: the error still surfaces.
  assert "step 1" in "\n".join(excinfo.value.__notes__)
  assert not callback(2, tiny(2))  # Raised once.
  assert callback(3, tiny(3))
  callback.close()
  assert callback.manager.all_steps() == [3]
  assert sorted_entries(ckpt_dir) == ["3"]


def test_background_error_surfaces_from_next_saving_call(ckpt_dir):
  """Fault injected: the storage backend's writes fail for step 1."""
  disk = FlakyDisk(on_fire=True)
  callback = CheckpointCallback(ckpt_dir, every_steps=1,
                                storage=Storage(backend=disk))
  assert callback(1, tiny(1))
  with pytest.raises(OSError, match="disk on fire"):
    callback(2, tiny(2))  # Raised whether or not the commit has ended yet.
  disk.on_fire = False
  assert callback(3, tiny(3))
  callback.close()
  assert callback.manager.all_steps() == [3]


def test_context_manager_closes_and_waits(ckpt_dir):
  with CheckpointCallback(ckpt_dir, every_steps=1) as callback:
    assert callback(1, tiny(1))
  assert not callback.manager.save_in_progress
  assert callback.manager.all_steps() == [1]
  assert sorted_entries(ckpt_dir) == ["1"]
  with pytest.raises(RuntimeError, match="closed"):
    callback(2, tiny(2))


def test_context_manager_keeps_loop_error_and_notes_save_error(ckpt_dir):
  """Fault injected: the storage backend's writes fail."""
  with pytest.raises(KeyError, match="loop failed") as excinfo:
    with CheckpointCallback(
        ckpt_dir, every_steps=1,
        storage=Storage(backend=FlakyDisk(on_fire=True))) as callback:
      callback(1, tiny(1))
      raise KeyError("loop failed")
  assert "disk on fire" in "\n".join(excinfo.value.__notes__)
  assert sorted_entries(ckpt_dir) == []


@pytest.mark.parametrize("kwargs", [{"every_steps": 0}, {"every_secs": 0}])
def test_invalid_triggers_raise(ckpt_dir, kwargs):
  with pytest.raises(ValueError):
    CheckpointCallback(ckpt_dir, **kwargs)


def test_a_resume_is_visible_in_a_plain_script(ckpt_dir, caplog):
  """A script that configures no logging shows warnings (Python's last
  resort handler): the resume is one."""
  with CheckpointCallback(ckpt_dir, every_steps=1) as cb:
    cb(4, _train_state(4))
  caplog.set_level(logging.WARNING)
  with CheckpointCallback(ckpt_dir) as cb:
    cb.restore_or_initialize(_train_state(0))
  assert [r.levelname for r in caplog.records
          if "resumed: restored step 4" in r.getMessage()] == ["WARNING"]


# -- a user coming from Orbax ----------------------------------------------------


def test_a_step_number_as_the_target_says_which_call_was_meant(
    ckpt_dir, make_state):
  """Orbax's habit `restore(manager.latest_step())`: the error says that
  the first argument is the target and shows the call meant."""
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(10, make_state())
    manager.wait_until_finished()
    for target in (manager.latest_step(), np.int64(10)):
      with pytest.raises(TypeError) as info:
        manager.restore(target)
      assert "the first argument is the target" in str(info.value)
      assert "Did you mean restore(target, step=10)?" in str(info.value)


def test_a_callback_without_a_trigger_says_so_at_once(ckpt_dir, caplog):
  """Orbax saves every step by default; a callback given no trigger saves
  only on a preemption notice, and says so when it is made."""
  with caplog.at_level(logging.WARNING, logger="flax_ckpt_plugin"):
    with CheckpointCallback(ckpt_dir) as cb:
      assert not any(cb(step, {"w": np.ones(2)}) for step in range(1, 6))
  (line,) = [r.getMessage() for r in caplog.records
             if "has no trigger" in r.getMessage()]
  assert "saves only when a preemption notice arrives" in line
  assert "every_steps=N (Orbax's save_interval_steps" in line
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="flax_ckpt_plugin"):
    CheckpointCallback(ckpt_dir, every_steps=2).close()
  assert not [r for r in caplog.records if "has no trigger" in r.getMessage()]


def test_the_callback_and_the_manager_keep_every_step_by_default(ckpt_dir):
  """As Orbax's manager: no step is deleted unless a rule says so."""
  with CheckpointCallback(ckpt_dir / "cb", every_steps=1) as cb:
    for step in range(1, 6):
      cb(step, {"w": np.full(2, step)})
      cb.wait_until_finished()
    assert cb.manager.all_steps() == [1, 2, 3, 4, 5]
  with CheckpointManager(ckpt_dir / "m") as manager:
    for step in range(1, 6):
      manager.save(step, {"w": np.full(2, step)})
      manager.wait_until_finished()
    assert manager.all_steps() == [1, 2, 3, 4, 5]


def test_a_closed_callback_says_so_at_every_call(ckpt_dir):
  """After close, a call on a trigger step and one on any other step both
  raise the same error, naming the callback (not a manager the user never
  made)."""
  cb = CheckpointCallback(ckpt_dir, every_steps=2)
  cb(2, {"w": np.ones(2)})
  cb.close()
  calls = [lambda: cb(3, {"w": np.ones(2)}), lambda: cb(4, {"w": np.ones(2)}),
           lambda: cb.restore_or_initialize({"w": np.ones(2)}),
           cb.wait_until_finished, lambda: cb.add_commit_hook(print)]
  for call in calls:
    with pytest.raises(RuntimeError,
                       match=r"CheckpointCallback for .* is closed"):
      call()


def test_extra_comes_back_as_json_reads_it(ckpt_dir):
  """numpy scalars come back as numbers, numpy arrays and tuples as lists
  (docs/loop.md, `extra`); a value JSON cannot hold names the rule."""
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, {"w": np.ones(2)}, extra={
        "rng": np.arange(3), "epoch": np.int64(2), "pair": (1, 2)})
    manager.wait_until_finished()
    assert manager.metadata(1).extra == {"rng": [0, 1, 2], "epoch": 2,
                                         "pair": [1, 2]}
    with pytest.raises(TypeError, match="numpy arrays as lists"):
      manager.save(2, {"w": np.ones(2)}, extra={"f": object()})
