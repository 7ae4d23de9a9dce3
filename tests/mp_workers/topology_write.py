"""Trains a sharded TrainState on an N x K mesh and saves one step.

    topology_write.py DIR MESH     e.g. MESH=2x4 for 4 processes x 2 devices

Trains 2 steps, saves step 2 with `CheckpointManager`, then restores it in the
same processes into the writer's own shardings. Prints the per-leaf digests
of the saved global arrays, the bytes this process wrote and owns (per leaf),
what the restore read, and how many arrays went through pinned host memory.
"""

import sys

import _topology as topo

topo.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import flax_ckpt_plugin
from flax_ckpt_plugin import Processes

STEP = 2


def main(directory: str, mesh_shape: str) -> dict:
  mesh = topo.make_mesh(topo.parse_shape(mesh_shape))
  state = topo.init_state(mesh)
  train_step = topo.make_train_step(mesh)
  pinned = topo.count_pinned()
  for _ in range(STEP):
    state = train_step(state)
  mgr = flax_ckpt_plugin.CheckpointManager(
      directory, processes=Processes(barrier_timeout_secs=60))
  mgr.warm_up(state, wait=True)  # As the callback's start does.
  mgr.save(STEP, state)
  mgr.wait_until_finished()
  target = topo.abstract_state(mesh, topo.SPECS)
  restored = mgr.restore(target)
  result = {
      "step": int(state.step),
      "all_steps": mgr.all_steps(),
      "digests": topo.leaf_digests(state),
      "saved_nbytes": mgr.last_save_stats.process_bytes,
      "owned_bytes": topo.owned_bytes_by_leaf(state),
      "array_bytes": topo.array_bytes_by_leaf(target),
      "restored": topo.leaf_digests(restored),
      "restored_on_target_shardings": topo.on_target_shardings(restored,
                                                               target),
      "nbytes_read": mgr.last_restore_stats.nbytes_read,
      "needed_bytes": topo.needed_bytes_by_leaf(target),
      "pinned": pinned,
  }
  mgr.close()
  return result


if __name__ == "__main__":
  topo.emit(main(sys.argv[1], sys.argv[2]))
