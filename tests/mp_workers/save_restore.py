"""Trains a sharded TrainState and saves it, or restores it in a new run.

    save_restore.py save DIR     train 6 steps, CheckpointCallback every 2
                                 steps, then restore in the same processes
    save_restore.py restore DIR  restore the newest step in fresh processes

Prints {"saved": {step: digests}, "restored": digests, ...}; digests are
sha256 per leaf of the full global array (see `_setup.leaf_digests`).
"""

import sys

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
from flax.training import train_state

import _train
import flax_ckpt_plugin
from flax_ckpt_plugin import Processes

NUM_STEPS, EVERY, KEEP = 6, 2, 2


def save(directory: str) -> dict:
  state = _train.init_state()
  train_step = _train.make_train_step()
  cb = flax_ckpt_plugin.CheckpointCallback(
      directory, every_steps=EVERY, max_to_keep=KEEP,
      processes=Processes(barrier_timeout_secs=30))
  saved = {}
  for step in range(1, NUM_STEPS + 1):
    state = train_step(state)
    if cb(step, state):
      # The digest is taken before the next step donates these buffers.
      saved[step] = _setup.leaf_digests(state)
  cb.wait_until_finished()
  target = _train.abstract_state()
  restored = cb.manager.restore(target)
  result = {
      "saved": saved,
      "all_steps": cb.manager.all_steps(),
      "restored_type": type(restored).__name__,
      "restored_on_target_shardings": _train.shardings_match(restored,
                                                             target),
      "restored": _setup.leaf_digests(restored),
      "total_array_bytes": _train.total_array_bytes(target),
      "owned_bytes": _train.owned_bytes(state),
  }
  cb.close()
  return result


def restore(directory: str) -> dict:
  cb = flax_ckpt_plugin.CheckpointCallback(
      directory, every_steps=EVERY, max_to_keep=KEEP,
      processes=Processes(barrier_timeout_secs=30))
  target = _train.abstract_state()
  state = cb.restore_or_initialize(target)
  # The same bytes under a partitioning the writer never used.
  alt_target = _train.abstract_state(_train.ALT_SPECS)
  alt = cb.manager.restore(alt_target)
  result = {
      "restored_step": cb.restored_step,
      "restored_type": type(state).__name__,
      "is_train_state": isinstance(state, train_state.TrainState),
      "restored_on_target_shardings": _train.shardings_match(state, target),
      "restored": _setup.leaf_digests(state),
      "alt_on_target_shardings": _train.shardings_match(alt, alt_target),
      "alt_restored": _setup.leaf_digests(alt),
  }
  # The restored state trains on: its arrays are live global arrays.
  state = _train.make_train_step()(state)
  result["step_after_training"] = int(state.step)
  cb.close()
  return result


if __name__ == "__main__":
  mode, directory = sys.argv[1], sys.argv[2]
  _setup.emit(save(directory) if mode == "save" else restore(directory))
