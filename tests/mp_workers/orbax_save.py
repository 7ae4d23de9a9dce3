"""Orbax saves a sharded TrainState from several processes.

    orbax_save.py DIR

N processes x 2 devices on an (N, 2) mesh, the kernels sharded on both axes
(`_topology.SPECS`). Trains 2 steps and saves step 2 with Orbax's own
`CheckpointManager` and `StandardSave`, as its documentation shows: each
process writes its shards into its own OCDBT database, which process 0
merges at the end. Emits the sha256 of every leaf's global value, by the
leaf's key path as our manifest names it, for the test to compare with what
`flax-ckpt import-orbax` converted.
"""

import os
import sys

import _topology as topo

topo.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import orbax.checkpoint as ocp

import _setup


def main(directory: str) -> dict:
  mesh = topo.make_mesh((topo.NUM_PROCESSES, 2))
  state = topo.init_state(mesh)
  train_step = topo.make_train_step(mesh)
  for _ in range(2):
    state = train_step(state)
  with ocp.CheckpointManager(os.path.abspath(directory)) as mngr:
    mngr.save(2, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
  digests = _setup.leaf_digests(state)
  paths = [topo.leaf_path(keypath) for keypath, _ in
           jax.tree_util.tree_flatten_with_path(state)[0]]
  return {"digests": dict(zip(paths, digests.values())),
          "sharded": sorted(topo.leaf_path(keypath) for keypath, leaf in
                            jax.tree_util.tree_flatten_with_path(state)[0]
                            if not leaf.is_fully_addressable)}


if __name__ == "__main__":
  topo.emit(main(sys.argv[1]))
