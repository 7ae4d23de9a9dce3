"""Local-tier steps on a file system in memory: written through mappings
kept from save to save, with a full file system an error and never a
crash, and no memory held for files that are gone."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.manager.tier import TierManager
from flax_ckpt_plugin.tolerance import local_tier
from flax_ckpt_plugin.backends import memfile


class _Process:
  process_index, process_count = 0, 1


def _tier(path, keep):
  return local_tier.LocalTier(TierManager.for_this_process(
      path, "job", coordinator=_Process(), keep=keep))


def _state(step, n):
  return {"w": jnp.arange(n, dtype=jnp.float32) + step,
          "b": jnp.full((7,), step, jnp.int32)}


def _used(path) -> int:
  st = os.statvfs(path)
  return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.fixture(autouse=True)
def _no_mappings_left():
  yield
  assert not len(memfile.MAPPINGS), "a closed tier left a mapping behind"


def test_saves_reuse_their_mappings_and_restore_bit_identical(small_tmpfs):
  n = 200_000  # 0.8 MB of float32.
  tier = _tier(small_tmpfs, keep=2)
  inodes = set()
  for step in range(1, 8):
    tier.manager.save(step, _state(step, n))
    tier.manager.wait_until_finished()
    data = tier.directory / str(step) / "data" / "process_00000.bin"
    inodes.add(os.stat(data).st_ino)
    # Two kept steps and the file the next save writes: three at most.
    assert 1 <= len(memfile.MAPPINGS) <= 3
  assert len(inodes) == 3  # The steps rotate through three files' pages.
  for step in (6, 7):
    restored = tier.manager.restore(_state(0, n), step)
    for key, value in _state(step, n).items():
      np.testing.assert_array_equal(restored[key], value)
  tier.manager.close()


def test_a_full_file_system_in_memory_fails_the_save_and_keeps_the_last_step(
    small_tmpfs):
  """8 MiB hold one step of 5 MB but not two: the second save is an error
  (a write into an unallocated mapped page would kill the process)."""
  n = 5 * 250_000
  tier = _tier(small_tmpfs, keep=1)
  tier.manager.save(1, _state(1, n))
  tier.manager.wait_until_finished()
  tier.manager.save(2, _state(2, n))
  with pytest.raises(OSError, match="No space left"):
    tier.manager.wait_until_finished()
  assert tier.manager.all_steps() == [1]
  restored = tier.manager.restore(_state(0, n), 1)
  np.testing.assert_array_equal(restored["w"], _state(1, n)["w"])
  tier.manager.close()


def test_a_wiped_directory_frees_its_memory_while_the_tier_is_open(
    small_tmpfs):
  """Kept mappings of the unlinked files would hold their pages: 8 MiB
  would then be too small for the next save."""
  n = 625_000  # 2.5 MB: three files fill 7.5 of the 8 MiB.
  tier = _tier(small_tmpfs, keep=2)
  for step in range(1, 5):
    tier.manager.save(step, _state(step, n))
    tier.manager.wait_until_finished()
  assert _used(small_tmpfs) > 7 << 20
  shutil.rmtree(tier.directory)
  tier.manager.save(5, _state(5, n))
  tier.manager.wait_until_finished()
  assert [p.name for p in tier.directory.iterdir() if p.name.isdigit()] == [
      "5"]
  assert _used(small_tmpfs) < 3 << 20
  restored = tier.manager.restore(_state(0, n), 5)
  np.testing.assert_array_equal(restored["w"], _state(5, n)["w"])
  tier.manager.close()


def _mixed(step):
  return {
      "f32": jnp.arange(300_000, dtype=jnp.float32) * step,
      "bf16": jnp.linspace(0, step, 1001, dtype=jnp.bfloat16),
      "i8": jnp.full((3, 5), step, jnp.int8),
      "i4": jnp.arange(16, dtype=jnp.int4) % 3,
      "flag": jnp.array(step % 2 == 0),
      "scalar": jnp.float32(step),
      "key": jax.random.key(step),
  }


def test_snapshots_taken_into_the_file_restore_every_dtype_after_donation(
    small_tmpfs):
  """The local tier's snapshot is copied into the file's pages at the save
  call: the state donated and changed right after does not reach them."""
  tier = _tier(small_tmpfs, keep=2)
  bump = jax.jit(lambda s: jax.tree.map(
      lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
      else (~x if x.dtype == jnp.bool_ else x + 1), s), donate_argnums=0)
  state = _mixed(1)
  for step in range(1, 6):
    tier.manager.save(step, state)
    state = bump(state)  # Donates what was just saved.
  tier.manager.wait_until_finished()
  for step in (4, 5):
    restored = tier.manager.restore(_mixed(0), step)
    expected = _mixed(1)
    for _ in range(step - 1):
      expected = jax.tree.map(
          lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
          else (~x if x.dtype == jnp.bool_ else x + 1), expected)
    for name, value in expected.items():
      got = restored[name]
      if name == "key":
        got, value = jax.random.key_data(got), jax.random.key_data(value)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(value), name)
  tier.manager.close()


def test_a_directory_that_several_processes_write_takes_no_snapshot_in_it(
    small_tmpfs):
  """Processes sharing a directory would share its spare file: only a
  directory of one process's own (a local tier) gets the arena."""
  from flax_ckpt_plugin import CheckpointManager  # pylint: disable=g-import-not-at-top
  shared = CheckpointManager(small_tmpfs / "shared")
  assert shared._staging.arena is None  # pylint: disable=protected-access
  shared.close()
  tier = _tier(small_tmpfs, keep=2)
  assert tier.manager._staging.arena is not None  # pylint: disable=protected-access
  tier.manager.close()
