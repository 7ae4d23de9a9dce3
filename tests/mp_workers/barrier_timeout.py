"""Process 0 saves while process 1 never calls `save`.

    barrier_timeout.py DIR

Process 0 reports the error its save ended with and how long it took; then
it sets the key `test/p0_done`, which process 1 waits for before closing its
manager and exiting (so process 1 is alive, just absent from the save, while
process 0 waits at the barrier).
"""

import sys
import time

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

BARRIER_TIMEOUT_SECS = 2.0
NAME = "barrier_timeout_test"
DONE_KEY = "test/p0_done"


def main(directory: str) -> dict:
  w = np.arange(16, dtype=np.float32).reshape(4, 4)
  state = {"w": jax.make_array_from_callback(
      w.shape, NamedSharding(_train.mesh(), P(("data", "model"))),
      lambda idx: w[idx])}
  mgr = flax_ckpt_plugin.CheckpointManager(
      directory,
      processes=Processes(barrier_timeout_secs=BARRIER_TIMEOUT_SECS, name=NAME))
  result = {"manager_name": mgr.name,
            "barrier_timeout_secs": BARRIER_TIMEOUT_SECS}
  if _setup.PROCESS_ID == 0:
    t0 = time.monotonic()
    try:
      mgr.save(1, state)
      mgr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      result["error"] = {"type": type(e).__name__,
                         "is_timeout": isinstance(e, TimeoutError),
                         "message": str(e)}
    result["error_secs"] = time.monotonic() - t0
    result["all_steps"] = mgr.all_steps()
    _setup.client().key_value_set(DONE_KEY, "1")
  else:
    # Generous: process 0 sets it a few seconds in. If it never does, this
    # raises and the worker fails rather than hanging.
    _setup.client().blocking_key_value_get(DONE_KEY, 60_000)
  mgr.close()
  return result


if __name__ == "__main__":
  _setup.emit(main(sys.argv[1]))
