"""Opens a checkpoint directory for writing and restores its newest step.

    open_restore.py URL

What a resumed job does at start, on every process: a `CheckpointManager`
on URL (a bucket), then `restore_newest_valid` into a target of one numpy
leaf `w` of 4 int64. Prints the step and `w`, so the test can count the
store's list requests per process count.
"""

import sys

import _setup

if _setup.NUM_PROCESSES > 1:
  _setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np

import flax_ckpt_plugin


def main(url: str) -> dict:
  with flax_ckpt_plugin.CheckpointManager(url,
                                          barrier_timeout_secs=60) as mgr:
    step, tree = mgr.restore_newest_valid({"w": np.zeros(4, np.int64)})
  return {"step": step, "w": tree["w"].tolist()}


if __name__ == "__main__":
  _setup.emit(main(sys.argv[1]))
