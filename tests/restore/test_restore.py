"""Tests of restore's structure matching (every mismatch named at once),
and of a restore without a target."""

import flax
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import StructureMismatchError
from flax_ckpt_plugin.restore import data_files
from helpers import adam_train_state as _train_state
from helpers import two_device_mesh


def _save(directory, tree):
  with CheckpointManager(directory) as manager:
    manager.save(1, tree)
  return directory / "1"


def _restore(directory, target):
  with CheckpointManager(directory, read_only=True) as manager:
    return manager.restore(target, 1)


def _no_data_reads(monkeypatch):
  """Makes any read of a data file fail the test."""
  def read_into(self, name, offset, out):
    del self, offset, out
    raise AssertionError(f"{name} was read before the structure was checked")
  monkeypatch.setattr(data_files.ByteReader, "read_into", read_into)


def test_every_mismatched_leaf_is_named_with_both_sides(ckpt_dir,
                                                        monkeypatch):
  _save(ckpt_dir, {"params": {"dense_0": {"kernel": jnp.zeros((8, 4))},
                              "dense_1": {"kernel": jnp.zeros((512, 10)),
                                          "bias": jnp.zeros(10)}},
                   "step": 3})
  _no_data_reads(monkeypatch)
  target = {"params": {"dense_0": {"kernel": jnp.zeros((8, 4), jnp.int32)},
                       "dense_1": {"kernel": jnp.zeros((512, 20)),
                                   "bias": jnp.zeros(10)}},
            "step": 0}
  with pytest.raises(StructureMismatchError) as info:
    _restore(ckpt_dir, target)
  message = str(info.value)
  assert str(ckpt_dir / "1") in message
  assert "2 leaves differ in shape or dtype" in message
  assert ("leaf 'params/dense_0/kernel': checkpoint has float32[8,4], target"
          " has int32[8,4]") in message
  assert ("leaf 'params/dense_1/kernel': checkpoint has float32[512,10],"
          " target has float32[512,20]") in message
  assert "bias" not in message


def test_mismatches_come_with_missing_and_unexpected_leaves(ckpt_dir,
                                                            monkeypatch):
  _save(ckpt_dir, {"a": np.zeros(2, np.float32), "b": jnp.zeros(3),
                   "old": jnp.zeros(1)})
  _no_data_reads(monkeypatch)
  with pytest.raises(StructureMismatchError) as info:
    _restore(ckpt_dir, {"a": np.zeros(5, np.float32), "b": jnp.zeros(3),
                        "new": jnp.zeros(1)})
  message = str(info.value)
  assert "target leaves not in the checkpoint: ['new']" in message
  assert "checkpoint leaves not in the target: ['old']" in message
  assert ("leaf 'a': checkpoint has float32[2], target has float32[5]"
          in message)


def test_many_mismatches_are_capped_with_a_count(ckpt_dir):
  _save(ckpt_dir, {f"w{i:02d}": jnp.zeros(2) for i in range(25)})
  with pytest.raises(StructureMismatchError) as info:
    _restore(ckpt_dir, {f"w{i:02d}": jnp.zeros(3) for i in range(25)})
  message = str(info.value)
  assert "25 leaves differ in shape or dtype" in message
  assert "leaf 'w19'" in message and "leaf 'w20'" not in message
  assert message.endswith("; and 5 more")


def test_one_mismatch_is_one_line_naming_the_leaf(ckpt_dir):
  _save(ckpt_dir, {"dense": {"kernel": jnp.zeros((512, 10))}, "lr": 0.1})
  with pytest.raises(StructureMismatchError) as info:
    _restore(ckpt_dir, {"dense": {"kernel": jnp.zeros((512, 20))}, "lr": 0.1})
  assert str(info.value) == ("leaf 'dense/kernel': checkpoint has"
                             " float32[512,10], target has float32[512,20]")


def test_restore_without_a_target_gives_plain_dicts_of_numpy_arrays(
    ckpt_dir):
  """`restore(None)`, as `flax.training.checkpoints` users do to look at a
  checkpoint: the tree as saved, string keys, whole numpy arrays."""
  mesh = two_device_mesh()
  sharded = jax.device_put(jnp.arange(8.0).reshape(4, 2),
                           NamedSharding(mesh, P("x")))
  tree = {"state": _train_state(7), "rng": jax.random.key(3),
          "host": np.arange(3, dtype=np.int16), "epoch": 5,
          "pair": [1.5, sharded]}
  with CheckpointManager(ckpt_dir) as m:
    m.save(7, tree)
    m.wait_until_finished()
    restored = m.restore(None)

  state = restored["state"]
  assert sorted(state) == ["opt_state", "params", "step"]
  assert sorted(state["opt_state"]) == ["0"]  # optax's EmptyState: no leaf.
  count = state["opt_state"]["0"]["count"]
  assert type(count) is np.ndarray and count.dtype == np.int32
  assert state["step"] == 7 and type(state["step"]) is np.ndarray
  assert type(state["params"]["w"]) is np.ndarray
  np.testing.assert_array_equal(state["params"]["w"], np.ones(3))
  np.testing.assert_array_equal(state["opt_state"]["0"]["mu"]["w"],
                                np.zeros(3))
  assert restored["epoch"] == 5 and type(restored["epoch"]) is int
  assert restored["host"].dtype == np.int16
  assert restored["pair"]["0"] == 1.5
  whole = restored["pair"]["1"]
  assert type(whole) is np.ndarray and whole.flags.writeable
  np.testing.assert_array_equal(whole, np.arange(8.0).reshape(4, 2))
  assert jax.numpy.issubdtype(restored["rng"].dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(jax.random.key_data(restored["rng"]),
                                jax.random.key_data(jax.random.key(3)))

  # The same key paths as the saved tree's: restoring the params of it
  # into the user's own tree works by path.
  params = flax.serialization.from_state_dict({"w": jnp.zeros(3)},
                                              state["params"])
  np.testing.assert_array_equal(params["w"], np.ones(3))
