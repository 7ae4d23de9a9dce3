"""Best-N retention in a real 2-process job whose processes disagree.

    best_n.py DIR

Each process saves a small sharded state at steps 1..6 with
`keep_best=2, best_metric="loss", max_to_keep=1`, passing a loss of its own:
process 0 one that ranks steps 2 and 4 best, process 1 one that ranks 1 and
5 best (per-host losses differ in real jobs). Only the primary's metrics are
recorded, so every process must keep what the primary's rank says. Prints
the steps each process lists after every save.
"""

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
from flax_ckpt_plugin import Retention

LOSS = {0: {1: 0.9, 2: 0.2, 3: 0.8, 4: 0.1, 5: 0.7, 6: 0.6},
        1: {1: 0.1, 2: 0.9, 3: 0.8, 4: 0.7, 5: 0.2, 6: 0.6}}


def main(directory: str) -> dict:
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  listed = {}
  with flax_ckpt_plugin.CheckpointManager(
      directory, max_to_keep=1,
      retention=Retention(keep_best=2, best_metric="loss"),
      processes=Processes(barrier_timeout_secs=60)) as manager:
    for step in range(1, 7):
      w = jax.make_array_from_callback(
          (8,), sharding, lambda idx, s=step: np.full(8, s, np.float32)[idx])
      manager.save(step, {"w": w, "step": jnp.int32(step)},
                   metrics={"loss": LOSS[_setup.PROCESS_ID][step]})
      manager.wait_until_finished()
      listed[step] = manager.all_steps()
  return {"listed": listed}


if __name__ == "__main__":
  _setup.emit(main(sys.argv[1]))
