"""Saves, then restores together, many small replicated leaves.

    many_leaves.py save DIR      step 4 of `values()`, replicated
    many_leaves.py restore DIR   fresh processes: restore_newest_valid

What a resumed job does at start: `restore_newest_valid` into the target
`leaves(jax.devices())` (each leaf replicated on every device of the job),
so the processes split the reading and share it (`shared_read`: small
leaves packed into one collective per batch). Prints whether every leaf is
the value saved, its sharding the target's, and the bytes this process
read.
"""

import sys

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

import flax_ckpt_plugin
from flax_ckpt_plugin import Processes

COUNT = 300
DTYPES = (np.float32, jnp.bfloat16, np.int8, np.bool_, np.int32)


def values() -> dict[str, np.ndarray]:
  """COUNT leaves of 2-24 KiB, of several dtypes, each of its own values."""
  out = {}
  for i in range(COUNT):
    dtype = np.dtype(DTYPES[i % len(DTYPES)])
    n = (2048 + 1024 * (i % 23)) // dtype.itemsize
    raw = np.random.default_rng(i).integers(0, 256, n * dtype.itemsize,
                                            np.uint8)
    value = raw.view(dtype) if dtype != np.bool_ else raw % 2 == 1
    out[f"leaf_{i:03d}"] = value.reshape(-1, 4) if i % 2 else value
  return out


def main(mode: str, directory: str) -> dict:
  everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("d",)),
                             PartitionSpec())
  want = values()
  if mode == "save":
    with flax_ckpt_plugin.CheckpointManager(
        directory, processes=Processes(barrier_timeout_secs=60)) as mgr:
      mgr.save(4, {k: jax.make_array_from_callback(  # Not device_put: its
          v.shape, everywhere, lambda i, v=v: v[i])  # check fails on NaN.
                   for k, v in want.items()})
    return {}
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=everywhere)
            for k, v in want.items()}
  with flax_ckpt_plugin.CheckpointManager(
      directory, processes=Processes(barrier_timeout_secs=60)) as mgr:
    step, tree = mgr.restore_newest_valid(target)
    read = mgr.last_restore_stats.nbytes_read
  wrong = [k for k, v in tree.items()
           if v.sharding != everywhere or not all(  # Bit for bit (NaNs).
               np.asarray(s.data).tobytes() == want[k].tobytes()
               for s in v.addressable_shards)]
  return {"step": step, "wrong": wrong, "read": read,
          "total": sum(v.nbytes for v in want.values())}


if __name__ == "__main__":
  _setup.emit(main(*sys.argv[1:]))
