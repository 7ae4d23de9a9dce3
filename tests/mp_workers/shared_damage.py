"""Restores the newest valid step together, two leaves shared in batches.

    shared_damage.py DIR LENGTH

What a resumed job does at start: `restore_newest_valid` into a target of
two float32 leaves `a` and `b` of LENGTH values, replicated on every device
of the job, so the processes split their reading and share it
(`shared_read`), one batch per leaf when LENGTH is large; and a typed PRNG
key `key`, which each process reads alone. Prints the step restored, each
leaf's sum, the key's data and the bytes this process read.
"""

import sys

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

import flax_ckpt_plugin
from flax_ckpt_plugin import Processes


def main(directory: str, length: str) -> dict:
  everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("d",)),
                             PartitionSpec())
  leaf = jax.ShapeDtypeStruct((int(length),), np.float32, sharding=everywhere)
  with flax_ckpt_plugin.CheckpointManager(
      directory, processes=Processes(barrier_timeout_secs=60)) as mgr:
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                               sharding=everywhere)
    step, tree = mgr.restore_newest_valid({"a": leaf, "b": leaf, "key": key})
    read = mgr.last_restore_stats.nbytes_read
  key = tree.pop("key")
  sums = {k: float(np.asarray(v.addressable_data(0)).sum(dtype=np.float64))
          for k, v in tree.items()}
  return {"step": step, "sums": sums, "read": read,
          "key": np.asarray(jax.random.key_data(key).addressable_data(
              0)).tolist()}


if __name__ == "__main__":
  _setup.emit(main(*sys.argv[1:]))
