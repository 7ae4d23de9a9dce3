"""A restore together in which one process's reads never return.

    hung_read.py DIR HUNG_PROCESS DEADLINE_SECS BARRIER_SECS MODE

Saves step 1 (a leaf replicated on every device, so the processes share
its reading, and one split over them), then restores it with
`restore_together` (MODE "together") or `restore_newest_valid` (MODE
"newest", after saving step 2 too); on process HUNG_PROCESS every read of
the newest step's data files blocks (`helpers.HangingDisk`, a fake).
Prints how the restore ended and after how many seconds.
"""

import sys
import time

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
from flax_ckpt_plugin import Storage
import helpers


def _state(mesh, value: int) -> dict:
  everywhere = NamedSharding(mesh, PartitionSpec())
  split = NamedSharding(mesh, PartitionSpec("d"))
  a = np.arange(1 << 18, dtype=np.float32) + value
  b = np.arange(64 * 16, dtype=np.int32).reshape(64, 16) * value
  return {"a": jax.make_array_from_callback(a.shape, everywhere,
                                            lambda i: a[i]),
          "b": jax.make_array_from_callback(b.shape, split, lambda i: b[i])}


def main(directory: str, hung: str, deadline: str, barrier: str,
         mode: str) -> dict:
  mesh = Mesh(np.array(jax.devices()), ("d",))
  steps = (1, 2) if mode == "newest" else (1,)
  with flax_ckpt_plugin.CheckpointManager(directory) as mgr:
    for step in steps:
      mgr.save(step, _state(mesh, step))
  target = jax.eval_shape(lambda: _state(mesh, 0))
  target = jax.tree.map(
      lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s.sharding),
      target, _state(mesh, 0))
  disk = helpers.HangingDisk(reads=f"/{steps[-1]}/") if (
      _setup.PROCESS_ID == int(hung)) else None
  result = {}
  t0 = time.monotonic()
  with flax_ckpt_plugin.CheckpointManager(
      directory, read_only=True,
      storage=Storage(backend=disk, io_timeout_secs=float(deadline)),
      processes=Processes(barrier_timeout_secs=float(barrier))) as mgr:
    try:
      if mode == "together":
        tree = mgr.restore_together(target, step=1)
        result["step"] = 1
      else:
        result["step"], tree = mgr.restore_newest_valid(target)
      result["a0"] = float(np.asarray(tree["a"].addressable_data(0))[0])
    except Exception as e:  # pylint: disable=broad-except
      result["error"] = {"type": type(e).__name__, "message": str(e)}
  result["secs"] = time.monotonic() - t0
  result["hung"] = disk is not None and disk.hung.is_set()
  if disk is not None:
    disk.unblock.set()
  return result


if __name__ == "__main__":
  _setup.emit(main(*sys.argv[1:]))
