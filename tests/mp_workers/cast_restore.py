"""Saves the sharded TrainState of `_train` in float32 on 2 processes, then
restores it with `cast=True` into a bfloat16 target (float leaves only; the
step counter stays int32), three ways: every process together
(`restore_together`, which shares the reads), each process alone
(`restore`), and through a callback whose local tier holds the step
(`restore_or_initialize(..., cast=True)`). The restore alone is into the
other layout (`_train.ALT_SPECS`).

    cast_restore.py DIR

Prints {"expected": digests, "together": ..., "alone": ..., "callback":
..., "tier": ...}: digests of the full global arrays (`_setup.leaf_digests`),
expected ones of `jnp.asarray(saved, jnp.bfloat16)`.
"""

import sys

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp

import _train
import flax_ckpt_plugin
from flax_ckpt_plugin import Processes
from flax_ckpt_plugin import FaultTolerance

DIR = sys.argv[1]


def bf16_target(specs=None):
  return jax.tree.map(
      lambda t: jax.ShapeDtypeStruct(
          t.shape, jnp.bfloat16 if jnp.issubdtype(t.dtype, jnp.floating)
          else t.dtype, sharding=t.sharding), _train.abstract_state(specs))


state = _train.init_state()
expected = _setup.leaf_digests(jax.tree.map(
    lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(
        x.dtype, jnp.floating) else x, state))
cb = flax_ckpt_plugin.CheckpointCallback(
    f"{DIR}/ckpt", every_steps=1,
    tolerance=FaultTolerance(local_directory=f"{DIR}/local_{_setup.PROCESS_ID}",
                             local_every_steps=1),
    processes=Processes(barrier_timeout_secs=30))
cb(1, state)
cb.close()
with flax_ckpt_plugin.CheckpointManager(f"{DIR}/ckpt", read_only=True) as m:
  together = _setup.leaf_digests(m.restore_together(bf16_target(), 1,
                                                    cast=True))
  alone = _setup.leaf_digests(m.restore(bf16_target(_train.ALT_SPECS), 1,
                                         cast=True))
cb = flax_ckpt_plugin.CheckpointCallback(
    f"{DIR}/ckpt", every_steps=1,
    tolerance=FaultTolerance(local_directory=f"{DIR}/local_{_setup.PROCESS_ID}",
                             local_every_steps=1),
    processes=Processes(barrier_timeout_secs=30))
restored = cb.restore_or_initialize(bf16_target(), cast=True)
tier = cb.restored_tier
callback = _setup.leaf_digests(restored)
cb.close()
_setup.emit({"expected": expected, "together": together, "alone": alone,
             "callback": callback, "tier": tier})
