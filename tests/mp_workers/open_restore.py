"""Opens a checkpoint directory for writing and restores its newest step.

    open_restore.py URL DTYPE LENGTH [x64]

What a resumed job does at start, on every process: a `CheckpointManager`
on URL (a bucket), then `restore_newest_valid` into a target of one leaf
`w` of LENGTH DTYPE, replicated on every device of the job; with `x64`,
inside `jax.enable_x64(True)`. Prints the step, `w`'s dtype, its first 4
values and its sum, and the bytes this process read, so the test can count
the store's requests per process count.
"""

import sys

import _setup

if _setup.NUM_PROCESSES > 1:
  _setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

import flax_ckpt_plugin
from flax_ckpt_plugin import Processes


def main(url: str, dtype: str, length: str, x64: str = "") -> dict:
  everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("d",)),
                             PartitionSpec())
  target = {"w": jax.ShapeDtypeStruct((int(length),), np.dtype(dtype),
                                      sharding=everywhere)}
  with flax_ckpt_plugin.CheckpointManager(
      url, processes=Processes(barrier_timeout_secs=60)) as mgr:
    with jax.enable_x64(x64 == "x64"):
      step, tree = mgr.restore_newest_valid(target)
    read = mgr.last_restore_stats.nbytes_read
  w = tree["w"]
  assert w.sharding == everywhere, w.sharding
  values = np.asarray(w.addressable_data(0))
  return {"step": step, "dtype": str(w.dtype), "head": values[:4].tolist(),
          "sum": int(values.sum(dtype=values.dtype)), "read": read}


if __name__ == "__main__":
  _setup.emit(main(*sys.argv[1:]))
