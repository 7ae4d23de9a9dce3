"""Fallback to an older step, agreed by every process.

    fallback_agreement.py save DIR     train 2 steps, save both
    fallback_agreement.py restore DIR  fresh processes: restore_or_initialize

2 processes x 2 devices; the state is sharded across both processes (see
`_train.SPECS`), so each process writes its own data file and, on restore,
reads mostly its own bytes.

`save` prints the digests of the state at every saved step. `restore` first
tries step 2 on each process alone (`restore` has no barrier: each process
reads only what its devices need), which shows which process can see the
damage the test made, then calls `restore_or_initialize`, and prints the step
it restored and the digests of the result.
"""

import sys

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import _train
import flax_ckpt_plugin
from flax_ckpt_plugin import Processes

BARRIER_TIMEOUT_SECS = 30


def _callback(directory: str) -> flax_ckpt_plugin.CheckpointCallback:
  return flax_ckpt_plugin.CheckpointCallback(
      directory, every_steps=1, max_to_keep=None,
      processes=Processes(barrier_timeout_secs=BARRIER_TIMEOUT_SECS))


def save(directory: str) -> dict:
  cb = _callback(directory)
  state = _train.init_state()
  train_step = _train.make_train_step()
  saved = {}
  for step in (1, 2):
    state = train_step(state)
    assert cb(step, state)
    # Taken before the next step donates these buffers.
    saved[step] = _setup.leaf_digests(state)
  cb.close()
  return {"saved": saved}


def restore(directory: str) -> dict:
  cb = _callback(directory)
  target = _train.abstract_state()
  try:
    cb.manager.restore(target, step=2)
    alone = "ok"
  except flax_ckpt_plugin.CheckpointCorruptedError as e:
    alone = f"CheckpointCorruptedError: {e}"
  state = cb.restore_or_initialize(target)
  result = {"step2_alone": alone, "restored_step": cb.restored_step,
            "restored": _setup.leaf_digests(state)}
  cb.close()
  return result


if __name__ == "__main__":
  mode, path = sys.argv[1], sys.argv[2]
  _setup.emit(save(path) if mode == "save" else restore(path))
