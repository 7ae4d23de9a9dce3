"""Small leaves are read together: a restore of thousands of small leaves
costs a few reads of the data file, not one per leaf, and stays checked.

The reads are counted by wrapping the local file's real `read_into` (a spy:
every read still goes to the file).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCorruptedError
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.backends import handles
from flax_ckpt_plugin.restore import data_files
from flax_ckpt_plugin.format import files

DTYPES = (np.float32, ml_dtypes.bfloat16, np.int8, np.int32)


def _many_leaves(n: int, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  out = {}
  for i in range(n):
    shape = ((i % 7) + 1, (i % 5) + 2)
    dtype = DTYPES[i % len(DTYPES)]
    out[f"leaf_{i:04d}"] = (rng.standard_normal(shape) * 50).astype(dtype)
  return out


@pytest.fixture
def count_reads(monkeypatch):
  """The number of reads of local data files, from here on."""
  calls = []
  real = handles.LocalFile.read_into

  def read_into(self, offset, out):
    calls.append(len(out))
    return real(self, offset, out)

  monkeypatch.setattr(handles.LocalFile, "read_into", read_into)
  return calls


def _save(directory, tree, step=1):
  with CheckpointManager(directory) as manager:
    manager.save(step, tree)


@pytest.mark.parametrize("verify", [True, False])
def test_a_thousand_small_leaves_restore_in_a_few_reads(ckpt_dir, count_reads,
                                                         verify):
  state = {k: jnp.asarray(v) for k, v in _many_leaves(1000).items()}
  _save(ckpt_dir, state)
  target = jax.eval_shape(lambda: state)
  count_reads.clear()
  with CheckpointManager(ckpt_dir, read_only=True) as manager:
    restored = manager.restore(target, 1, verify=verify)
  for key, value in state.items():
    assert restored[key].dtype == value.dtype, key
    assert np.asarray(restored[key]).tobytes() == np.asarray(value).tobytes(), key
  # Leaves are handed to the threads in batches of up to 128, each batch
  # read in one go: 8 reads, where there were 1000.
  assert 0 < len(count_reads) <= 10, len(count_reads)


def test_restore_into_numpy_targets_reads_together_too(ckpt_dir, count_reads):
  state = _many_leaves(300, seed=1)
  _save(ckpt_dir, state)
  count_reads.clear()
  with CheckpointManager(ckpt_dir, read_only=True) as manager:
    restored = manager.restore({k: np.zeros_like(v) for k, v in state.items()},
                               1)
  for key, value in state.items():
    assert restored[key].tobytes() == value.tobytes(), key
  assert 0 < len(count_reads) <= 4, len(count_reads)


def test_large_leaves_are_read_straight_into_their_arrays(ckpt_dir,
                                                          count_reads):
  """A leaf of at least `COALESCE_BYTES` is not copied through a span."""
  big = np.arange(3 * data_files.COALESCE_BYTES // 4, dtype=np.float32)
  state = {"big": jnp.asarray(big), **{k: jnp.asarray(v) for k, v in
                                       _many_leaves(20, seed=2).items()}}
  _save(ckpt_dir, state)
  count_reads.clear()
  with CheckpointManager(ckpt_dir, read_only=True) as manager:
    restored = manager.restore(jax.eval_shape(lambda: state), 1,
                               verify=False)
    stats = manager.last_restore_stats
  np.testing.assert_array_equal(np.asarray(restored["big"]), big)
  assert big.nbytes in count_reads  # One read of exactly its bytes.
  # The small leaves' span is read once, around nothing else.
  assert stats.nbytes_read < big.nbytes + 64 * 1024 + sum(
      np.asarray(v).nbytes for k, v in state.items() if k != "big")


def test_a_flipped_byte_in_a_leaf_read_with_others_names_that_leaf(ckpt_dir):
  state = {k: jnp.asarray(v) for k, v in _many_leaves(50, seed=3).items()}
  _save(ckpt_dir, state)
  _save(ckpt_dir, state, step=2)
  manifest = json.loads((ckpt_dir / "2" / files.MANIFEST).read_text())
  (leaf,) = [l for l in manifest["leaves"] if "leaf_0017" in l["path"]]
  (shard,) = leaf["shards"]
  with open(ckpt_dir / "2" / shard["file"], "r+b") as f:
    f.seek(shard["offset"] + 1)
    byte = f.read(1)[0]
    f.seek(shard["offset"] + 1)
    f.write(bytes([byte ^ 0xFF]))
  target = jax.eval_shape(lambda: state)
  with CheckpointManager(ckpt_dir, read_only=True) as manager:
    with pytest.raises(CheckpointCorruptedError) as info:
      manager.restore(target, 2)
    message = str(info.value)
    assert "leaf_0017" in message and "checksum mismatch" in message
    assert shard["file"] in message and "step 2" in message
    # The other step, read the same way, is whole.
    restored = manager.restore(target, 1)
  assert np.asarray(restored["leaf_0017"]).tobytes() == np.asarray(
      state["leaf_0017"]).tobytes()
