"""A second job opens a directory that another job writes, and saves a step.

    second_writer.py DIR STEP SEED

One process without `jax.distributed`: a job started on the same directory
by mistake, or a restart while the old job still runs. Opening a
`CheckpointManager` claims DIR (`_WRITER`); it then saves a small state made
from SEED as STEP, with no retention, so it deletes nothing of the other
job's. Prints its pid and host, the steps it lists, and the bytes of every
array it saved (hex), so the test can check them bit for bit.
"""

import os
import socket
import sys

import _setup  # pylint: disable=unused-import  # Sets XLA_FLAGS first.

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import numpy as np

import flax_ckpt_plugin


def main(directory: str, step: int, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((16, 8), dtype=np.float32)
  state = {"w": jnp.asarray(w), "step": step}
  with flax_ckpt_plugin.CheckpointManager(directory,
                                          max_to_keep=None) as manager:
    manager.save(step, state)
    manager.wait_until_finished()
    steps = manager.all_steps()
  return {"pid": os.getpid(), "host": socket.gethostname(),
          "all_steps": steps, "w_hex": w.tobytes().hex()}


if __name__ == "__main__":
  _setup.emit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
