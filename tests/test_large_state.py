"""A ~1 GB TrainState saved asynchronously and restored by a new process.

The new process imports this module for the model and the digest function,
restores into an abstract target and prints per-leaf sha256 digests as JSON.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager

pytestmark = pytest.mark.multiprocess

# 8 x 3200 x 3200 float32 = 328 MB of params; with adam's mu and nu, 983 MB.
LAYERS = 8
WIDTH = 3200
STATE_BYTES = 3 * LAYERS * WIDTH * WIDTH * 4

_TX = optax.adam(1e-3)


class Tower(nn.Module):
  """A stack of square Dense layers without bias."""

  @nn.compact
  def __call__(self, x):
    for _ in range(LAYERS):
      x = nn.Dense(WIDTH, use_bias=False)(x)
    return x


_MODEL = Tower()


def init_state(key: jax.Array) -> train_state.TrainState:
  params = _MODEL.init(key, jnp.zeros((1, WIDTH), jnp.float32))
  return train_state.TrainState.create(apply_fn=_MODEL.apply, params=params,
                                       tx=_TX)


def _step(state: train_state.TrainState,
          x: jax.Array) -> train_state.TrainState:
  def loss_fn(params):
    return jnp.mean(state.apply_fn(params, x) ** 2)
  return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))


def leaf_digests(tree) -> dict[str, str]:
  """sha256 of dtype, shape and raw bytes of every leaf, by key path."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    arr = np.ascontiguousarray(np.asarray(leaf))
    digest = hashlib.sha256(f"{arr.dtype.name}{arr.shape}".encode())
    digest.update(arr.reshape(-1).view(np.uint8))
    out[jax.tree_util.keystr(path)] = digest.hexdigest()
  return out


def restore_digests(directory: str) -> dict:
  """What the new process does: restore the newest step, digest its leaves."""
  target = jax.eval_shape(init_state, jax.random.key(0))
  manager = CheckpointManager(directory)
  restored = manager.restore(target)
  assert type(restored) is train_state.TrainState
  return {"step": manager.latest_step(), "digests": leaf_digests(restored)}


_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_large_state
print(json.dumps(test_large_state.restore_digests(sys.argv[2])))
"""


@pytest.mark.timeout(600)
def test_one_gigabyte_state_restores_bit_identical_in_new_process(ckpt_dir):
  # One adam step, so that mu and nu are not all zeros.
  state = jax.jit(init_state)(jax.random.key(0))
  batch = jax.random.normal(jax.random.key(1), (16, WIDTH), jnp.float32)
  state = jax.jit(_step, donate_argnums=0)(state, batch)
  jax.block_until_ready(state)
  assert sum(x.nbytes for x in jax.tree.leaves(state)) >= STATE_BYTES

  try:
    with CheckpointCallback(ckpt_dir, every_steps=1,
                            max_to_keep=1) as callback:
      t0 = time.perf_counter()
      assert callback(1, state)
      blocking = time.perf_counter() - t0
      running_after_return = callback.manager.save_in_progress
      expected = leaf_digests(state)  # Overlaps with the background commit.
      callback.wait_until_finished()
    stats = callback.manager.last_save_stats
    print(f"\nsave of {stats.process_bytes / 1e9:.2f} GB: callback blocked"
          f" {blocking:.3f}s (snapshot {stats.blocking_secs:.3f}s), commit"
          f" {stats.commit_secs:.2f}s, still committing when the call"
          f" returned: {running_after_return}")
    assert stats.process_bytes >= STATE_BYTES
    assert stats.blocking_secs < stats.commit_secs
    del state

    t0 = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, os.path.dirname(__file__),
         os.fspath(ckpt_dir)],
        capture_output=True, text=True, timeout=400, check=False,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    print(f"restore in a new process took {time.perf_counter() - t0:.2f}s")
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["step"] == 1
    assert result["digests"] == expected
  finally:
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # 1 GB; pytest keeps tmp dirs.
