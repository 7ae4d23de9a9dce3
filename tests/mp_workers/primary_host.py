"""A manager whose primary host is process 1.

    primary_host.py DIR

2 processes x 2 devices on a (2, 2) mesh. Opens `CheckpointManager(DIR,
primary_host=1, max_to_keep=2)` (the test leaves unfinished steps in DIR
first), saves steps 1..4 of a tree holding the sharded TrainState and a host
numpy table (host values are written by the primary host only), then restores
the newest step. Logs at INFO, so the library's `[process=N]` lines show who
removed unfinished steps and who applied retention.
"""

import sys

import _topology as topo

topo.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np

import flax_ckpt_plugin
from flax_ckpt_plugin import Processes

NUM_STEPS, KEEP, PRIMARY = 4, 2, 1
MESH = (2, 2)


def main(directory: str) -> dict:
  mesh = topo.make_mesh(MESH)
  state = topo.init_state(mesh)
  train_step = topo.make_train_step(mesh)
  mgr = flax_ckpt_plugin.CheckpointManager(
      directory, max_to_keep=KEEP,
      processes=Processes(primary_host=PRIMARY, barrier_timeout_secs=60))
  saved = {}
  for step in range(1, NUM_STEPS + 1):
    state = train_step(state)
    tree = {"state": state,
            "table": np.arange(6, dtype=np.int64).reshape(2, 3) * step}
    mgr.save(step, tree)
    saved[step] = topo.leaf_digests(tree)
    mgr.wait_until_finished()
  target = {"state": topo.abstract_state(mesh, topo.SPECS),
            "table": np.zeros((2, 3), np.int64)}
  restored = mgr.restore(target)
  result = {
      "is_primary": mgr.is_primary,
      "all_steps": mgr.all_steps(),
      "latest_step": mgr.latest_step(),
      "saved": saved,
      "restored": topo.leaf_digests(restored),
      "table_type": type(restored["table"]).__name__,
  }
  mgr.close()
  return result


if __name__ == "__main__":
  topo.emit(main(sys.argv[1]))
