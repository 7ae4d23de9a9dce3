"""Tests of CheckpointManager: save, list, restore, errors, retention."""

import json
import os
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_ckpt_plugin import CheckpointExistsError
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import CheckpointNotFoundError
from flax_ckpt_plugin import CommitHookError
from flax_ckpt_plugin.restore import data_files
from flax_ckpt_plugin.arrays import copies as copies_lib
from flax_ckpt_plugin.save import writer
from flax_ckpt_plugin import Processes
from flax_ckpt_plugin import Storage
from flax_ckpt_plugin import Retention

from helpers import FlakyDisk
from helpers import entries
from helpers import join_commit
from helpers import tiny
from helpers import wait_for_compiles

# Long enough never to fire on a loaded machine; the tests never wait it out.
TIMEOUT = 60


class GatedWrite:
  """Holds every background data write until `release` is set.

  Fault injected: replaces writer.write_process_files; the real write runs
  once the test sets `release`.
  """

  def __init__(self, monkeypatch):
    self.entered = threading.Event()
    self.release = threading.Event()
    self.step_dirs = []
    self._real = writer.write_process_files
    monkeypatch.setattr(writer, "write_process_files", self)

  def __call__(self, step_dir, leaves, process_index, **kwargs):
    self.step_dirs.append(step_dir)
    self.entered.set()
    if not self.release.wait(TIMEOUT):
      raise TimeoutError("the test never released the write")
    return self._real(step_dir, leaves, process_index, **kwargs)


@pytest.fixture
def gated_write(monkeypatch):
  gate = GatedWrite(monkeypatch)
  yield gate
  gate.release.set()  # Never leave a commit thread blocked after a failure.


def test_save_wait_list_restore(ckpt_dir, make_state, train_step,
                                assert_trees_equal, host_copy):
  manager = CheckpointManager(ckpt_dir)
  assert manager.latest_step() is None
  assert manager.all_steps() == []
  state = train_step(make_state())
  expected = host_copy(state)
  manager.save(1, state)
  manager.wait_until_finished()
  assert not manager.save_in_progress
  assert manager.latest_step() == 1
  assert manager.all_steps() == [1]
  assert entries(ckpt_dir) == {"1"}
  assert entries(ckpt_dir / "1") == {"_COMMITTED", "manifest.json", "data"}

  target = train_step(make_state(seed=1))
  assert_trees_equal(manager.restore(target), expected)
  stats = manager.last_save_stats
  assert stats.step == 1
  assert stats.process_bytes == os.path.getsize(
      ckpt_dir / "1" / "data" / "process_00000.bin")
  manager.close()


def test_restore_takes_type_and_static_fields_from_target(ckpt_dir, make_state,
                                                          train_step):
  state = train_step(train_step(make_state()))
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(2, state)
  target = make_state(seed=1).replace(apply_fn=lambda *args: "target's",
                                      tx=optax.adam(5e-3))
  restored = CheckpointManager(ckpt_dir).restore(target)
  assert type(restored) is type(state)
  assert restored.apply_fn is target.apply_fn
  assert restored.tx is target.tx
  # The target's step is a Python int (TrainState.create), so it stays one.
  assert type(restored.step) is int and restored.step == 2


def test_restored_state_continues_training_identically(
    ckpt_dir, make_state, train_step, assert_trees_equal, host_copy):
  state = train_step(make_state())
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, state)
  restored = CheckpointManager(ckpt_dir).restore(train_step(make_state(7)))
  continued = host_copy(train_step(train_step(restored)))
  assert_trees_equal(continued, host_copy(train_step(train_step(state))))


def test_restore_older_step(ckpt_dir, make_state, train_step,
                            assert_trees_equal, host_copy):
  manager = CheckpointManager(ckpt_dir)
  state = train_step(make_state())
  expected = {}
  for step in (1, 2, 3):
    expected[step] = host_copy(state)
    manager.save(step, state)
    state = train_step(state)
  manager.wait_until_finished()
  assert manager.all_steps() == [1, 2, 3]
  assert_trees_equal(manager.restore(state, step=1), expected[1])
  assert_trees_equal(manager.restore(state, step=2), expected[2])
  assert_trees_equal(manager.restore(state), expected[3])
  manager.close()


def test_restore_without_checkpoints_raises_not_found(ckpt_dir, make_state):
  manager = CheckpointManager(ckpt_dir)
  with pytest.raises(CheckpointNotFoundError, match=str(ckpt_dir)):
    manager.restore(make_state())
  with pytest.raises(CheckpointNotFoundError):
    manager.metadata()
  with pytest.raises(FileNotFoundError):  # The built-in it subclasses.
    manager.restore(make_state(), step=0)


def test_restore_of_unfinished_step_raises_not_found(ckpt_dir, make_state):
  manager = CheckpointManager(ckpt_dir)
  manager.save(1, make_state())
  manager.wait_until_finished()
  # A commit-file writer of step 7 still at work: all files but the marker.
  shutil.copytree(ckpt_dir / "1", ckpt_dir / "7")
  os.remove(ckpt_dir / "7" / "_COMMITTED")
  with pytest.raises(CheckpointNotFoundError,
                     match=r"step 7 is not a finalized checkpoint.*\[1\]"):
    manager.restore(make_state(), step=7)
  with pytest.raises(CheckpointNotFoundError, match="step 3"):
    manager.restore(make_state(), step=3)
  with pytest.raises(CheckpointNotFoundError, match="step 7"):
    manager.metadata(7)
  assert manager.all_steps() == [1]


def test_saving_a_finalized_step_raises_synchronously(ckpt_dir, make_state):
  manager = CheckpointManager(ckpt_dir)
  manager.save(1, make_state())
  manager.wait_until_finished()
  manifest = (ckpt_dir / "1" / "manifest.json").read_bytes()
  with pytest.raises(CheckpointExistsError, match="step 1"):
    manager.save(1, make_state(seed=3))
  assert not manager.save_in_progress
  with pytest.raises(FileExistsError):  # From a new manager too.
    CheckpointManager(ckpt_dir).save(1, make_state(seed=3))
  assert (ckpt_dir / "1" / "manifest.json").read_bytes() == manifest


@pytest.mark.parametrize("atomicity", ["rename", "commit_file"])
def test_losing_writer_never_deletes_finalized_step(
    ckpt_dir, make_state, atomicity, assert_trees_equal, host_copy):
  """Two managers on one directory both save step 5; the one that opened the
  directory before step 5 existed does not know it is finalized. Its save must
  fail without touching the step the other one finalized."""
  late = CheckpointManager(ckpt_dir, storage=Storage(atomicity=atomicity))
  early = CheckpointManager(ckpt_dir, storage=Storage(atomicity=atomicity))
  winner = make_state(seed=1)
  expected = host_copy(winner)
  early.save(5, winner)
  early.wait_until_finished()

  late.save(5, make_state(seed=2))
  with pytest.raises(FileExistsError, match="step 5"):
    late.wait_until_finished()

  fresh = CheckpointManager(ckpt_dir, storage=Storage(atomicity=atomicity))
  assert fresh.all_steps() == [5]
  assert_trees_equal(fresh.restore(make_state()), expected)


def test_extra_and_metrics_round_trip(ckpt_dir, make_state):
  extra = {"data_position": 12345, "epoch": 3, "seen": [1, 2, 3],
           "host_rng": {"seed": 7, "name": "pcg64"}, "none": None,
           "lr": 0.000125, "done": False}
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(4, make_state(), extra=extra,
                 metrics={"loss": jnp.float32(0.25), "accuracy": 1,
                          "grad_norm": np.float64(1.5)})
  meta = CheckpointManager(ckpt_dir).metadata(4)
  assert meta.step == 4
  assert meta.extra == extra
  assert meta.metrics == {"loss": 0.25, "accuracy": 1.0, "grad_norm": 1.5}
  assert meta.process_count == 1
  assert meta.total_bytes == os.path.getsize(
      ckpt_dir / "4" / "data" / "process_00000.bin")
  manifest = json.loads((ckpt_dir / "4" / "manifest.json").read_text())
  assert manifest["extra"] == extra


# (numpy scalars are accepted: test_data_state.py.)
@pytest.mark.parametrize("extra", [
    {"iterator": object()}, {"loss": float("nan")},
    {"loss": np.float32("nan")}, {("tuple", "key"): 1},
], ids=["object", "nan", "numpy_nan", "tuple_key"])
def test_non_json_extra_raises_type_error_at_save(ckpt_dir, make_state, extra):
  manager = CheckpointManager(ckpt_dir)
  with pytest.raises(TypeError, match="extra must be JSON-serializable"):
    manager.save(1, make_state(), extra=extra)
  assert not manager.save_in_progress
  assert entries(ckpt_dir) == set()
  manager.save(1, make_state())  # Nothing was left half started.
  manager.close()
  assert manager.all_steps() == [1]


def test_non_number_metric_raises_type_error_at_save(ckpt_dir, make_state):
  manager = CheckpointManager(ckpt_dir)
  with pytest.raises(TypeError, match="metric 'loss'"):
    manager.save(1, make_state(), metrics={"loss": "low"})
  assert entries(ckpt_dir) == set()


def test_snapshot_survives_donation(ckpt_dir, make_state, train_step,
                                    gated_write, assert_trees_equal,
                                    host_copy):
  """The data write is held (fault injected: gated write) until the saved
  state's buffers were donated to, and reused by, several train steps."""
  manager = CheckpointManager(ckpt_dir)
  state = train_step(make_state())
  expected = host_copy(state)
  manager.save(1, state)
  assert gated_write.entered.wait(TIMEOUT)
  for _ in range(5):
    state = train_step(state)
  # The steps donated the saved buffers and wrote into them: the
  # checkpoint must still hold the values at the time of `save`.
  gated_write.release.set()
  manager.wait_until_finished()

  assert not np.array_equal(state.params["params"]["Dense_0"]["kernel"],
                            expected.params["params"]["Dense_0"]["kernel"])
  assert_trees_equal(manager.restore(state), expected)
  manager.close()


def _kernel_shards(state) -> list[int]:
  kernel = state.opt_state[0].mu["params"]["Dense_0"]["kernel"]
  return sorted(s.data.unsafe_buffer_pointer()
                for s in kernel.addressable_shards)


def test_save_leaves_the_state_donatable_and_reuses_its_staging(
    ckpt_dir, make_state, train_step, assert_trees_equal, host_copy,
    monkeypatch):
  """A save must not pin the state: the next step's donation is accepted
  (its output reuses the input's memory). Shards of at least REUSE_BYTES
  (all of them here) are copied into reused staging memory from the
  second save on (the first save compiles nothing; its programs compile
  in the background), and each save after that copies into the memory of
  the one before."""
  monkeypatch.setattr(copies_lib, "REUSE_BYTES", 0)
  state = train_step(make_state())
  # The control: a numpy view pins a buffer, and the step then writes its
  # output elsewhere, so the address check below can fail.
  before = _kernel_shards(state)
  pin = np.asarray(state.opt_state[0].mu["params"]["Dense_0"]["kernel"])
  state = train_step(state)
  assert _kernel_shards(state) != before
  del pin

  manager = CheckpointManager(ckpt_dir)
  staging, expected = [], {}
  for step in (1, 2, 3, 4):
    before = _kernel_shards(state)
    expected[step] = host_copy(state)
    manager.save(step, state)
    state = train_step(state)
    assert _kernel_shards(state) == before, f"save {step} pinned the state"
    manager.wait_until_finished()
    wait_for_compiles()
    staging.append(sorted(
        a.unsafe_buffer_pointer()
        for arrays in manager._staging._device.values() for a in arrays))  # pylint: disable=protected-access
  assert not staging[0]  # Copied by the runtime, while the programs compile.
  assert staging[1] and staging[1] == staging[2] == staging[3]
  for step in (1, 2, 3, 4):
    assert_trees_equal(manager.restore(state, step), expected[step])
  manager.close()


@pytest.mark.parametrize("sharded", [False, True])
def test_restored_state_is_donatable(sharded, ckpt_dir, make_state,
                                     train_step, assert_trees_equal,
                                     host_copy):
  """The first step after a restore donates it: its output reuses the
  restored memory, as after any step (a restore whose arrays the runtime
  would not donate makes that step copy the whole state, with two states
  alive at once)."""
  state = train_step(make_state())
  expected = host_copy(state)
  manager = CheckpointManager(ckpt_dir)
  manager.save(1, state)
  manager.wait_until_finished()
  target = jax.eval_shape(lambda: state)
  if sharded:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    target = jax.tree.map(
        lambda a: a.update(sharding=jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(*("x",)[:a.ndim == 2]))),
        target)
  # The control: memory handed to the runtime by device_put is not donated,
  # so the address check below can fail.
  def adopt(a, t):
    buf = data_files.host_buffer(a.shape, a.dtype)
    np.copyto(buf, a)
    return jax.device_put(buf, t.sharding)
  adopted = jax.tree.map(adopt, expected, target)
  before = _kernel_shards(adopted)
  assert _kernel_shards(train_step(adopted)) != before

  restored = manager.restore(target, 1)
  assert_trees_equal(restored, expected)
  before = _kernel_shards(restored)
  assert _kernel_shards(train_step(restored)) == before
  manager.close()


def test_restored_arrays_own_their_memory(ckpt_dir, make_state, train_step,
                                          assert_trees_equal, host_copy):
  """Restored arrays are filled in place: no two restores (of any leaf,
  scalars included) may share a buffer, or the second would overwrite the
  first."""
  manager = CheckpointManager(ckpt_dir)
  state = make_state()
  expected = {}
  for step in (1, 2):
    state = train_step(state)
    expected[step] = host_copy(state)
    manager.save(step, state)
  manager.wait_until_finished()
  target = jax.eval_shape(lambda: state)
  first = manager.restore(target, 1)
  second = manager.restore(target, 2)
  assert_trees_equal(first, expected[1])
  assert_trees_equal(second, expected[2])
  addresses = [a.unsafe_buffer_pointer()
               for tree in (first, second) for a in jax.tree.leaves(tree)]
  assert len(set(addresses)) == len(addresses)
  manager.close()


def test_saving_a_donated_state_raises_synchronously(ckpt_dir, make_state,
                                                     train_step):
  state = train_step(make_state())
  train_step(state)  # Donates `state`.
  manager = CheckpointManager(ckpt_dir)
  with pytest.raises(ValueError, match="was deleted"):
    manager.save(1, state)
  assert not manager.save_in_progress
  assert entries(ckpt_dir) == set()


@pytest.mark.parametrize("surface", ["save", "wait_until_finished", "close"])
def test_background_error_is_raised_once_by_next_call(
    surface, ckpt_dir, make_state, train_step, assert_trees_equal, host_copy):
  """Fault injected: the storage backend's writes fail for step 2."""
  disk = FlakyDisk()
  manager = CheckpointManager(ckpt_dir, storage=Storage(backend=disk))
  state = train_step(make_state())
  expected = host_copy(state)
  manager.save(1, state)
  manager.wait_until_finished()

  disk.on_fire = True
  manager.save(2, state)  # Returns: the failure happens in the background.
  call = getattr(manager, surface)
  args = (3, state) if surface == "save" else ()
  with pytest.raises(OSError, match="disk on fire") as excinfo:
    call(*args)
  notes = "\n".join(getattr(excinfo.value, "__notes__", []))
  assert "ASYNCHRONOUSLY" in notes
  assert f"step 2 in {ckpt_dir}" in notes

  disk.on_fire = False
  if surface == "save":
    manager.save(3, state)  # Raised once: the next save goes ahead.
    manager.wait_until_finished()
    want = [1, 3]
  else:
    call()  # Raised once: the same call now succeeds.
    want = [1]
  assert manager.all_steps() == want
  assert entries(ckpt_dir) == {str(s) for s in want}  # No "2.partial".
  manager.close()

  fresh = CheckpointManager(ckpt_dir)
  assert fresh.all_steps() == want
  assert_trees_equal(fresh.restore(state, step=1), expected)


def test_background_error_is_raised_by_restore(ckpt_dir, make_state):
  """Fault injected: the storage backend's writes fail for step 2."""
  disk = FlakyDisk()
  manager = CheckpointManager(ckpt_dir, storage=Storage(backend=disk))
  manager.save(1, make_state())
  manager.wait_until_finished()
  disk.on_fire = True
  manager.save(2, make_state())
  join_commit(manager, TIMEOUT)
  with pytest.raises(OSError, match="disk on fire"):
    manager.restore(make_state())
  assert manager.restore(make_state()).step == 0  # Raised only once.


def test_save_blocks_only_while_previous_commit_runs(
    ckpt_dir, make_state, gated_write, assert_trees_equal, host_copy):
  """Fault injected: the data write of every save waits on an Event."""
  manager = CheckpointManager(ckpt_dir)
  first, second = make_state(seed=1), make_state(seed=2)
  expected_second = host_copy(second)
  manager.save(1, first)  # Returns although its write cannot proceed.
  assert gated_write.entered.wait(TIMEOUT)
  assert manager.save_in_progress
  assert manager.all_steps() == []
  assert entries(ckpt_dir) == {"1.partial"}

  returned = threading.Event()
  errors = []

  def save_second():
    try:
      manager.save(2, second)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
    finally:
      returned.set()

  thread = threading.Thread(target=save_second)
  thread.start()
  # A negative check has to wait a little; the gate guarantees that the save
  # cannot legitimately return during this window.
  assert not returned.wait(0.3)
  assert manager.all_steps() == []

  gated_write.release.set()
  thread.join(TIMEOUT)
  assert not thread.is_alive()
  assert not errors
  manager.wait_until_finished()
  assert manager.all_steps() == [1, 2]
  assert_trees_equal(manager.restore(make_state(), step=2), expected_second)
  manager.close()


def test_retention_keeps_newest_and_every_nth(ckpt_dir):
  manager = CheckpointManager(ckpt_dir, max_to_keep=2,
                              retention=Retention(keep_every_n_steps=5))
  for step in range(1, 13):
    manager.save(step, tiny(step))
  manager.wait_until_finished()
  assert manager.all_steps() == [5, 10, 11, 12]
  assert entries(ckpt_dir) == {"5", "10", "11", "12"}
  for step in (5, 10, 11, 12):
    restored = manager.restore(tiny(0), step=step)
    np.testing.assert_array_equal(restored["w"], [step] * 3)
  manager.close()
  assert CheckpointManager(ckpt_dir).all_steps() == [5, 10, 11, 12]


def test_max_to_keep_one_never_leaves_zero_steps(ckpt_dir):
  """Fault injected: the write of step 4 raises OSError."""
  disk = FlakyDisk()
  manager = CheckpointManager(ckpt_dir, max_to_keep=1,
                              storage=Storage(backend=disk))
  for step in (1, 2, 3):
    manager.save(step, tiny(step))
    manager.wait_until_finished()
    assert manager.all_steps() == [step]
    assert entries(ckpt_dir) == {str(step)}
  disk.on_fire = True
  manager.save(4, tiny(4))
  with pytest.raises(OSError, match="disk on fire"):
    manager.wait_until_finished()
  assert entries(ckpt_dir) == {"3"}
  np.testing.assert_array_equal(manager.restore(tiny(0))["w"], [3] * 3)


def test_old_steps_deleted_only_after_newer_one_is_finalized(
    ckpt_dir, gated_write):
  """Fault injected: the write of step 3 is held on an Event, the write of
  step 4 raises OSError."""
  gated_write.release.set()
  disk = FlakyDisk()
  manager = CheckpointManager(ckpt_dir, max_to_keep=2,
                              storage=Storage(backend=disk))
  manager.save(1, tiny(1))
  manager.save(2, tiny(2))
  manager.wait_until_finished()

  gated_write.release.clear()
  gated_write.entered.clear()
  manager.save(3, tiny(3))
  assert gated_write.entered.wait(TIMEOUT)
  assert entries(ckpt_dir) == {"1", "2", "3.partial"}
  assert manager.all_steps() == [1, 2]
  gated_write.release.set()
  manager.wait_until_finished()
  assert entries(ckpt_dir) == {"2", "3"}

  disk.on_fire = True
  manager.save(4, tiny(4))
  with pytest.raises(OSError, match="disk on fire"):
    manager.wait_until_finished()
  assert manager.all_steps() == [2, 3]
  assert entries(ckpt_dir) == {"2", "3"}


def test_retention_applies_to_steps_of_an_earlier_run(ckpt_dir):
  with CheckpointManager(ckpt_dir) as earlier:
    for step in (1, 2, 3, 4):
      earlier.save(step, tiny(step))
  manager = CheckpointManager(ckpt_dir, max_to_keep=2)
  assert manager.latest_step() == 4
  manager.save(5, tiny(5))
  manager.wait_until_finished()
  assert manager.all_steps() == [4, 5]
  assert entries(ckpt_dir) == {"4", "5"}


def test_commit_file_mode_on_local_directory(ckpt_dir, make_state,
                                             gated_write, assert_trees_equal,
                                             host_copy):
  """The write is spied on (fault injected: gated write) to see where the
  data goes while the save is unfinished."""
  manager = CheckpointManager(ckpt_dir, storage=Storage(atomicity="commit_file"))
  assert manager.atomicity == "commit_file"
  state = make_state(seed=4)
  expected = host_copy(state)
  manager.save(1, state)
  assert gated_write.entered.wait(TIMEOUT)
  assert os.fspath(gated_write.step_dirs[0]) == os.fspath(ckpt_dir / "1")
  assert entries(ckpt_dir) == {"1"}
  assert not (ckpt_dir / "1" / "_COMMITTED").exists()
  # An observer (read-only, as an evaluation job) does not list it.
  assert CheckpointManager(
      ckpt_dir, read_only=True,
      storage=Storage(atomicity="commit_file")).all_steps() == []

  gated_write.release.set()
  manager.wait_until_finished()
  assert entries(ckpt_dir) == {"1"}
  assert (ckpt_dir / "1" / "_COMMITTED").exists()
  assert_trees_equal(manager.restore(make_state()), expected)
  manager.close()


def test_stale_temporary_directories_are_removed_on_open(
    ckpt_dir, make_state, assert_trees_equal, host_copy):
  state = make_state(seed=1)
  expected = host_copy(state)
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, state)
  # What crashed saves leave: a full '.partial' (even with a marker inside),
  # and a commit-file step without its marker.
  shutil.copytree(ckpt_dir / "1", ckpt_dir / "2.partial")
  shutil.copytree(ckpt_dir / "1", ckpt_dir / "3")
  os.remove(ckpt_dir / "3" / "_COMMITTED")

  manager = CheckpointManager(ckpt_dir)
  assert entries(ckpt_dir) == {"1"}
  assert manager.all_steps() == [1]
  assert manager.latest_step() == 1
  for step in (2, 3):
    with pytest.raises(CheckpointNotFoundError):
      manager.restore(make_state(), step=step)
  assert_trees_equal(manager.restore(make_state()), expected)


def test_closed_manager_refuses_calls(ckpt_dir, make_state):
  manager = CheckpointManager(ckpt_dir)
  manager.close()
  manager.close()  # Idempotent.
  with pytest.raises(RuntimeError, match="closed"):
    manager.save(1, make_state())


def test_context_manager_waits_for_the_save(ckpt_dir, make_state,
                                            gated_write):
  """Fault injected: the write waits on an Event, set before leaving."""
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, make_state())
    assert gated_write.entered.wait(TIMEOUT)
    assert manager.all_steps() == []
    gated_write.release.set()
  assert manager.all_steps() == [1]
  assert entries(ckpt_dir) == {"1"}


@pytest.mark.parametrize("kwargs", [
    {"max_to_keep": 0},
    {"retention": lambda: Retention(keep_every_n_steps=0)},
    {"processes": lambda: Processes(primary_host=1)},  # One process: 0 only.
    {"max_to_keep": 2, "retention": lambda: Retention(max_to_keep=3)},
])
def test_invalid_options_raise_value_error(ckpt_dir, kwargs):
  with pytest.raises(ValueError):
    CheckpointManager(ckpt_dir, **{k: v() if callable(v) else v
                                   for k, v in kwargs.items()})


def test_negative_step_raises(ckpt_dir, make_state):
  with pytest.raises(ValueError, match="step must be >= 0"):
    CheckpointManager(ckpt_dir).save(-1, make_state())


def test_commit_hooks_see_each_finalized_step_in_order(ckpt_dir):
  """A hook can read the step it is given: it is durable and complete."""
  seen = []

  def evaluate(stats):
    # What an evaluation hook does: open the directory read-only, restore.
    with CheckpointManager(ckpt_dir, read_only=True) as reader:
      restored = reader.restore({"w": np.zeros(3, np.float32)}, stats.step)
    seen.append(("evaluate", stats.step, float(restored["w"][0]),
                 (stats.path / "_COMMITTED").is_file(), stats.total_bytes,
                 threading.current_thread() is threading.main_thread()))

  mgr = CheckpointManager(ckpt_dir, max_to_keep=1,
                          hooks=[evaluate])
  mgr.add_commit_hook(lambda stats: seen.append(("notify", stats.step)))
  for step in (1, 2):
    mgr.save(step, {"w": np.full(3, step, np.float32)})
    mgr.wait_until_finished()
  mgr.close()
  assert seen == [("evaluate", 1, 1.0, True, 12, False), ("notify", 1),
                  ("evaluate", 2, 2.0, True, 12, False), ("notify", 2)]
  assert mgr.last_save_stats.path == ckpt_dir / "2"
  assert mgr.last_save_stats.gbytes_per_sec > 0
  assert entries(ckpt_dir) == {"2"}  # Retention ran after the hooks.


def test_failing_commit_hook_is_raised_once_and_keeps_the_step(ckpt_dir):
  def broken(stats):
    if stats.step == 2:
      raise ConnectionError("notification service unreachable")

  later = []
  mgr = CheckpointManager(ckpt_dir, max_to_keep=1,
                          hooks=[broken, later.append])
  mgr.save(1, {"w": np.ones(3)})
  mgr.wait_until_finished()
  mgr.save(2, {"w": np.ones(3)})
  with pytest.raises(CommitHookError) as info:
    mgr.save(3, {"w": np.ones(3)})  # The next call raises it.
  message = str(info.value)
  assert "broken" in message and "step 2" in message and str(ckpt_dir) in message
  assert "notification service unreachable" in message
  assert isinstance(info.value.__cause__, ConnectionError)
  # Step 2 is durable; retention and the later hook were skipped for it.
  assert mgr.all_steps() == [1, 2] and entries(ckpt_dir) == {"1", "2"}
  assert [s.step for s in later] == [1]
  mgr.save(3, {"w": np.ones(3)})  # Raised once: saving goes on.
  mgr.close()
  assert mgr.all_steps() == [3] and [s.step for s in later] == [1, 3]


def test_commit_hook_must_be_callable(ckpt_dir):
  with pytest.raises(TypeError, match="not callable"):
    CheckpointManager(ckpt_dir, hooks=["not a function"])
