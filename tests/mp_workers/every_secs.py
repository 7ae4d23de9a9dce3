"""`every_secs` with a different clock on every process.

    every_secs.py DIR

The clock is injected: CLOCK_RATE in the environment says how many fake
seconds pass per step on this process, so the processes disagree on whether
`EVERY_SECS` have elapsed, as hosts with skewed clocks or uneven step times
would. Prints the steps at which the callback saved.
"""

import os
import sys

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import _train
import flax_ckpt_plugin
from flax_ckpt_plugin import Processes
from flax_ckpt_plugin.loop import triggers

EVERY_SECS = 3.5
NUM_STEPS = 12
CLOCK_RATE = float(os.environ["CLOCK_RATE"])


def main(directory: str) -> dict:
  mesh = _train.mesh()
  w = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
  state = {
      "w": jax.make_array_from_callback(
          w.shape, NamedSharding(mesh, P(("data", "model"))),
          lambda idx: w[idx]),
      "b": jax.make_array_from_callback(
          (4,), NamedSharding(mesh, P()), lambda idx: w[0][idx]),
  }
  now = [0.0]
  triggers.monotonic = lambda: now[0]  # This process's own clock.
  cb = flax_ckpt_plugin.CheckpointCallback(
      directory, every_secs=EVERY_SECS, max_to_keep=None,
      processes=Processes(barrier_timeout_secs=30))
  saved = []
  for step in range(1, NUM_STEPS + 1):
    now[0] = CLOCK_RATE * step
    if cb(step, state):
      saved.append(step)
  cb.close()
  return {"saved": saved, "all_steps": cb.manager.all_steps()}


if __name__ == "__main__":
  _setup.emit(main(sys.argv[1]))
