"""Tests of restore's structure matching: every mismatch named at once."""

import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import StructureMismatchError
from flax_ckpt_plugin.restore import reader as reader_lib


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
  monkeypatch.setattr(reader_lib.ByteReader, "read_into", read_into)


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
