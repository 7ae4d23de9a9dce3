"""Processes that disagree about the state they save (a user bug).

    hardening.py disagree DIR   saves step 1 (good) with max_to_keep=1, then
                                step 2 with process 1 saving `w` as
                                bfloat16 (process 0: float32), then step 3
                                with each process sharding `w` by another
                                PartitionSpec; restores the newest step.

2 processes x 2 devices. Prints each save's error, the steps left and the
restored values.
"""

import os
import sys

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import flax_ckpt_plugin
from flax_ckpt_plugin import Processes

VALUES = np.arange(64, dtype=np.float32).reshape(8, 8)


def _array(spec: P, dtype) -> jax.Array:
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2),
                           ("data", "model"))
  return jax.make_array_from_callback(
      VALUES.shape, NamedSharding(mesh, spec),
      lambda index: VALUES[index].astype(dtype))


def disagree(directory: str) -> dict:
  pid = jax.process_index()
  good = {"w": _array(P("data", None), np.float32)}
  cases = {
      "dtype": {"w": _array(P("data", None),
                            jnp.bfloat16 if pid == 1 else np.float32)},
      "spec": {"w": _array(P("data", None) if pid == 0 else P(None, "data"),
                           np.float32)},
  }
  errors = {}
  with flax_ckpt_plugin.CheckpointManager(
      os.path.join(directory, "run"), max_to_keep=1,
      processes=Processes(barrier_timeout_secs=30)) as mgr:
    mgr.save(1, good)
    mgr.wait_until_finished()
    for step, (name, state) in enumerate(cases.items(), start=2):
      try:
        mgr.save(step, state)
        mgr.wait_until_finished()
      except Exception as e:  # pylint: disable=broad-except
        errors[name] = f"{type(e).__name__}: {e}"
    steps = mgr.all_steps()
    found = mgr.restore_newest_valid(good)
  restored = None
  if found is not None:  # This process's shards, each against the values.
    restored = [found[0], all(
        np.array_equal(np.asarray(s.data), VALUES[s.index])
        for s in found[1]["w"].addressable_shards)]
  return {"errors": errors, "all_steps": steps, "restored": restored}


if __name__ == "__main__":
  mode, path = sys.argv[1], sys.argv[2]
  _setup.emit({"disagree": disagree}[mode](path))
