"""Restores the newest step into this run's topology, in fresh processes.

    topology_restore.py DIR MESH LAYOUT[,LAYOUT...]

LAYOUT is 'same' (the writer's PartitionSpecs on this run's MESH, e.g. 1x2),
'alt' (other PartitionSpecs, see `_topology.ALT_SPECS`) or 'plain' (the bare
`jax.eval_shape` target: no shardings, so one local device). Prints, per
layout, the digests of the restored global arrays, whether they sit on the
target's shardings, the bytes this process read and the bytes its target
shards need per leaf.
"""

import sys

import _topology as topo

topo.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
from flax.training import train_state
import jax

import flax_ckpt_plugin
from flax_ckpt_plugin import Processes


def _target(layout: str, mesh_shape: str):
  if layout == "plain":
    return topo.plain_abstract_state()
  mesh = topo.make_mesh(topo.parse_shape(mesh_shape))
  return topo.abstract_state(mesh, topo.LAYOUTS[layout])


def main(directory: str, mesh_shape: str, layouts: str) -> dict:
  # Read-only, as an evaluation job reading a training job's directory.
  mgr = flax_ckpt_plugin.CheckpointManager(
      directory, read_only=True, processes=Processes(barrier_timeout_secs=60))
  result = {"process_count": topo.NUM_PROCESSES,
            "local_devices": len(jax.local_devices())}
  for layout in layouts.split(","):
    target = _target(layout, mesh_shape)
    restored = mgr.restore(target)  # Checksums verified (the default).
    verified_nbytes_read = mgr.last_restore_stats.nbytes_read
    # Without verification a process reads exactly the bytes it needs; with
    # it, the whole checksum blocks around them.
    unverified = mgr.restore(target, verify=False)
    result[layout] = {
        "step": mgr.last_restore_stats.step,
        "is_train_state": isinstance(restored, train_state.TrainState),
        "on_target_shardings": topo.on_target_shardings(restored, target),
        "digests": topo.leaf_digests(restored),
        "unverified_digests": topo.leaf_digests(unverified),
        "verified_nbytes_read": verified_nbytes_read,
        "nbytes_read": mgr.last_restore_stats.nbytes_read,
        "needed_bytes": topo.needed_bytes_by_leaf(target),
        "array_bytes": topo.array_bytes_by_leaf(target),
    }
  mgr.close()
  return result


if __name__ == "__main__":
  topo.emit(main(*sys.argv[1:4]))
