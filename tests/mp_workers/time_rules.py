"""Time-based retention in a real 2-process job whose clocks disagree.

    time_rules.py DIR

Each process saves a small sharded state at steps 1..6 with
`keep_every_secs=25, max_to_keep=1`, its retention clock faked: process 0's
goes 10 s forward per save (it keeps steps 1 and 4 for the interval),
process 1's goes backward (alone, it would keep step 1 alone for it).
Only the primary's clock and records decide, so every process must keep
what the primary's say. Prints the steps each process lists after every
save.
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
from flax_ckpt_plugin.manager import retention as retention_lib

CLOCK = {0: lambda step: 1000.0 + 10 * step, 1: lambda step: 5000.0 - step}


def main(directory: str) -> dict:
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  listed = {}
  now = [0.0]
  retention_lib.now = lambda: now[0]
  with flax_ckpt_plugin.CheckpointManager(
      directory, retention=Retention(max_to_keep=1, keep_every_secs=25),
      processes=Processes(barrier_timeout_secs=60)) as manager:
    for step in range(1, 7):
      now[0] = CLOCK[_setup.PROCESS_ID](step)
      w = jax.make_array_from_callback(
          (8,), sharding, lambda idx, s=step: np.full(8, s, np.float32)[idx])
      manager.save(step, {"w": w, "step": jnp.int32(step)})
      manager.wait_until_finished()
      listed[step] = manager.all_steps()
  return {"listed": listed}


if __name__ == "__main__":
  _setup.emit(main(sys.argv[1]))
