"""`every_steps=AutoInterval(...)` with other measures on every process.

    auto_interval.py DIR WAIT


Each process's clock is injected and runs at its own pace: process 0's
steps take 1 fake second and its saves block the loop 2 (its data
iterator's state takes that long to get), process 1's take 2 and 32. Each
process alone would choose another interval; prints the steps at which the
callback saved and what this process measured. WAIT "1": the loop waits
for each save's commit before its next step; "0": the commits run beside
the steps, and each save reads the primary's interval right after waiting
for the previous commit, in the callback.
"""

import statistics
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
from flax_ckpt_plugin import AutoInterval
from flax_ckpt_plugin import Processes
from flax_ckpt_plugin.loop import triggers

NUM_STEPS = 100
STEP_SECS, COST_SECS = [(1.0, 2.0), (2.0, 32.0)][_setup.PROCESS_ID]


class CostlyIterator:
  """A data iterator whose state takes COST_SECS of the fake clock."""

  def __init__(self, clock):
    self.clock = clock

  def get_state(self):
    self.clock[0] += COST_SECS
    return b"position"

  def set_state(self, state):
    del state


def main(directory: str, wait: bool) -> dict:
  mesh = _train.mesh()
  w = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
  state = {"w": jax.make_array_from_callback(
      w.shape, NamedSharding(mesh, P(("data", "model"))), lambda idx: w[idx])}
  now = [0.0]
  triggers.monotonic = lambda: now[0]  # This process's own clock.
  cb = flax_ckpt_plugin.CheckpointCallback(
      directory, every_steps=AutoInterval(mtbf_secs=100.0, min_every_steps=5),
      processes=Processes(barrier_timeout_secs=30))
  cb.data_iterator = CostlyIterator(now)
  saved = []
  for step in range(1, NUM_STEPS + 1):
    now[0] += STEP_SECS
    if cb(step, state):
      saved.append(step)
      if wait:
        cb.wait_until_finished()
  cb.close()
  costs = cb.triggers.schedule.costs
  return {"saved": saved, "all_steps": cb.manager.all_steps(),
          "local": {"step_secs": costs.step_secs(), "cost_secs":
                    statistics.fmean(s.blocking_secs for s in costs.saves)}}


if __name__ == "__main__":
  _setup.emit(main(sys.argv[1], sys.argv[2] == "1"))
