"""The local tier on one process: what it writes, keeps and restores."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from flax_ckpt_plugin.backends import registry as backend_lib
from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointNotFoundError
from flax_ckpt_plugin.tolerance import generations
from flax_ckpt_plugin.loop import tiers
from flax_ckpt_plugin.manager.tier import TierManager
from flax_ckpt_plugin.tolerance import local_tier
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin import FaultTolerance

from fake_coordinator import run_threads
from helpers import sorted_entries
from helpers import two_device_mesh


def _process_dir(local, ckpt_dir) -> str:
  return os.path.join(local, generations.job_name(str(ckpt_dir)),
                      "process_00000")


def _run(cb, make_state, train_step, steps):
  state = cb.restore_or_initialize(make_state())
  for step in steps:
    state = train_step(state)
    cb(step, state)
  cb.close()
  return state


def test_the_local_tier_keeps_its_newest_two_steps_apart_from_the_persistent(
    tmp_path, ckpt_dir, make_state, train_step):
  local = tmp_path / "local"
  cb = CheckpointCallback(
      ckpt_dir, every_steps=5, max_to_keep=None,
      tolerance=FaultTolerance(local_directory=local, local_every_steps=2))
  _run(cb, make_state, train_step, range(1, 10))
  assert sorted_entries(ckpt_dir) == ["5"]
  mine = _process_dir(local, ckpt_dir)
  assert sorted_entries(mine) == ["6", "8"]
  text = open(os.path.join(mine, "8", "manifest.json"), "rb").read()
  parsed = manifest_lib.parse(text, "local step 8")
  assert parsed.scope == (0, 1)


def test_a_restore_takes_the_newest_step_from_the_fastest_tier(
    tmp_path, ckpt_dir, make_state, train_step, assert_trees_equal,
    host_copy):
  local = tmp_path / "local"
  kwargs = dict(every_steps=5, tolerance=FaultTolerance(
      local_directory=local, local_every_steps=2))
  cb = CheckpointCallback(ckpt_dir, **kwargs)
  # A target whose step is an array, as in the states saved.
  target = lambda: jax.tree.map(jnp.zeros_like, train_step(make_state()))
  state = cb.restore_or_initialize(make_state())
  at = {}
  for step in range(1, 10):
    state = train_step(state)
    cb(step, state, extra={"step": step})
    at[step] = host_copy(state)
  cb.close()

  cb = CheckpointCallback(ckpt_dir, **kwargs)
  restored = cb.restore_or_initialize(target())
  assert (cb.restored_step, cb.restored_tier) == (8, "local")
  assert cb.restored_extra == {"step": 8}
  assert_trees_equal(host_copy(restored), at[8])
  cb.close()

  # Damage the newest local step: the older local one (6) is newer than
  # the persistent tier's 5.
  data = os.path.join(_process_dir(local, ckpt_dir), "8", "data",
                      "process_00000.bin")
  with open(data, "r+b") as f:
    f.seek(10)
    byte = f.read(1)
    f.seek(10)
    f.write(bytes([byte[0] ^ 0xFF]))
  cb = CheckpointCallback(ckpt_dir, **kwargs)
  restored = cb.restore_or_initialize(target())
  assert (cb.restored_step, cb.restored_tier) == (6, "local")
  assert_trees_equal(host_copy(restored), at[6])
  cb.close()

  # The local tier gone (a new host): the persistent tier serves.
  shutil.rmtree(local)
  cb = CheckpointCallback(ckpt_dir, **kwargs)
  restored = cb.restore_or_initialize(target())
  assert (cb.restored_step, cb.restored_tier) == (5, "persistent")
  assert_trees_equal(host_copy(restored), at[5])
  cb.close()


def test_a_step_of_one_process_holds_every_distinct_shard_it_had(
    tmp_path, ckpt_dir):
  """Replicas included, each distinct shard once; and a target that places
  shards it does not hold is a clear miss, before any read."""
  mesh = two_device_mesh()
  replicated = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P()))
  split = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
  state = {"r": replicated, "s": split}
  tier = local_tier.LocalTier(TierManager.for_this_process(
      tmp_path / "local", "job",
      coordinator=_Process(1, 4)))
  tier.manager.save(3, state)
  tier.manager.wait_until_finished()
  m = manifest_lib.read(tier.directory / "3")
  assert m.scope == (1, 4)
  shards = {leaf.path: [s.index for s in leaf.shards] for leaf in m.leaves}
  assert shards == {"r": [((0, 8),)], "s": [((0, 4),), ((4, 8),)]}
  restored = tier.manager.restore(state, 3)
  np.testing.assert_array_equal(restored["s"], np.arange(8.0))

  # A step that holds half an array, read for a target that wants all of it.
  text = json.loads((tier.directory / "3" / "manifest.json").read_text())
  text["leaves"][1]["shards"] = text["leaves"][1]["shards"][:1]
  (tier.directory / "3" / "manifest.json").write_text(json.dumps(text))
  with pytest.raises(CheckpointNotFoundError, match=r"leaf 's'.*region"):
    tier.manager.restore(state, 3)
  tier.manager.close()


class _Process:
  """A coordinator that names a process of a bigger job (the tier only asks
  who it is)."""

  def __init__(self, index, count):
    self.process_index, self.process_count = index, count


def test_nothing_is_fsynced_on_a_file_system_in_memory(tmp_path,
                                                        small_tmpfs):
  assert backend_lib.for_own_path(small_tmpfs / "x") is backend_lib.MEMORY
  assert backend_lib.for_own_path(tmp_path) is backend_lib.LOCAL
  tier = local_tier.LocalTier(TierManager.for_this_process(
      small_tmpfs, "job", coordinator=_Process(0, 1)))
  assert tier.manager.backend is backend_lib.MEMORY
  tier.manager.save(1, {"w": jnp.ones(4)})
  tier.manager.close()
  assert (tier.directory / "1" / "_COMMITTED").exists()


@pytest.mark.parametrize("kwargs", [
    {"local_directory": "/tmp/x"}, {"local_every_steps": 3},
    {"local_directory": "/tmp/x", "local_every_steps": 0}])
def test_the_local_tier_needs_a_path_and_an_interval(kwargs):
  with pytest.raises(ValueError, match="local"):
    FaultTolerance(**kwargs)


def test_without_a_local_tier_the_restored_tier_is_the_persistent_one(
    ckpt_dir):
  cb = CheckpointCallback(ckpt_dir, every_steps=1)
  cb(1, {"w": jnp.ones(3)})
  cb.close()
  cb = CheckpointCallback(ckpt_dir)
  assert cb.restored_tier is None
  cb.restore_or_initialize({"w": jnp.zeros(3)})
  assert (cb.restored_step, cb.restored_tier) == (1, "persistent")
  cb.close()


def test_in_memory_a_new_step_overwrites_the_data_file_of_a_deleted_one(
    small_tmpfs):
  tier = local_tier.LocalTier(TierManager.for_this_process(
      small_tmpfs, "job", coordinator=_Process(0, 1),
      keep=1))
  data = lambda step: tier.directory / str(step) / "data/process_00000.bin"
  spare = tier.directory / backend_lib.SPARE_FILE
  tier.manager.save(1, {"w": jnp.arange(100_000.0)})
  tier.manager.save(2, {"w": jnp.arange(100_000.0) + 2})
  tier.manager.wait_until_finished()
  assert spare.exists() and not (tier.directory / "1").exists()
  inode = os.stat(spare).st_ino
  # A smaller state: the reused file is cut to its new size.
  tier.manager.save(3, {"w": jnp.arange(1000.0) + 3})
  tier.manager.wait_until_finished()
  assert os.stat(data(3)).st_ino == inode
  assert os.stat(data(3)).st_size == 4000
  restored = tier.manager.restore({"w": jnp.zeros(1000)}, 3)
  np.testing.assert_array_equal(restored["w"], np.arange(1000.0) + 3)
  tier.manager.close()


def test_local_steps_newer_than_the_restored_one_are_discarded_and_saved_anew(
    tmp_path, ckpt_dir):
  """A run that resumes before them replays those steps: keeping the old
  copies would mix two pasts in a later restore."""
  local = tmp_path / "local"
  kwargs = dict(every_steps=5, tolerance=FaultTolerance(
      local_directory=local, local_every_steps=2))
  cb = CheckpointCallback(ckpt_dir, **kwargs)
  for step in range(1, 10):
    cb(step, {"w": jnp.full(3, step)})
  cb.close()
  mine = _process_dir(local, ckpt_dir)
  for step in ("6", "8"):  # Both local steps damaged: step 5 restores.
    with open(os.path.join(mine, step, "data", "process_00000.bin"),
              "r+b") as f:
      f.write(b"\xff" * 4)
  cb = CheckpointCallback(ckpt_dir, **kwargs)
  restored = cb.restore_or_initialize({"w": jnp.zeros(3, jnp.int32)})
  assert (cb.restored_step, cb.restored_tier) == (5, "persistent")
  assert [e for e in sorted_entries(mine) if e.isdigit()] == []
  for step in range(6, 10):  # A different past: values + 100.
    cb(step, {"w": jnp.full(3, step + 100)})
  cb.close()
  cb = CheckpointCallback(ckpt_dir, **kwargs)
  restored = cb.restore_or_initialize({"w": jnp.zeros(3, jnp.int32)})
  assert (cb.restored_step, cb.restored_tier) == (8, "local")
  np.testing.assert_array_equal(restored["w"], [108] * 3)
  cb.close()


def test_a_failing_local_tier_is_logged_and_the_loop_goes_on(
    small_tmpfs, ckpt_dir, caplog):
  """The 8 MiB tmpfs cannot hold a 16 MiB state: the local save fails on
  this process only, which must not stop its loop (its peers would wait
  for it in their next collective)."""
  cb = CheckpointCallback(
      ckpt_dir, every_steps=2,
      tolerance=FaultTolerance(local_directory=small_tmpfs,
                               local_every_steps=1))
  for step in range(1, 5):
    assert cb(step, {"w": jnp.full(4 << 20, step, jnp.float32)})
  cb.close()
  assert sorted_entries(ckpt_dir) == ["2", "4"]
  assert "the local tier's save" in caplog.text
  assert "No space left" in caplog.text


def test_a_local_tier_that_fails_to_open_on_one_process_is_off_on_all(
    tmp_path, caplog):
  """Every process must take the same path through a restore: a local
  path that is not a directory on process 1 turns the tier off on both."""
  (tmp_path / "local_1").write_text("a file, not a directory")

  def open_on(coord):
    return tiers.open_tier(tmp_path / f"local_{coord.process_index}",
                                "job", coordinator=coord, timeout_ms=10_000)

  assert run_threads(2, open_on) == [None, None]
  assert "the local tier in" in caplog.text and "is off" in caplog.text
  good = run_threads(2, lambda c: tiers.open_tier(
      tmp_path / f"fine_{c.process_index}", "job", coordinator=c,
      timeout_ms=10_000))
  assert [t.directory.name for t in good] == ["process_00000",
                                              "process_00001"]
  for t in good:
    t.manager.close()
