"""Two managers in one program: a train state and its EMA, interleaved.

    two_managers.py TRAIN_DIR EMA_DIR

2 processes x 2 devices on a (2, 2) mesh. Every step trains, updates an
exponential moving average of the params (a second tree), then saves the
state with the "train" manager and the EMA with the "ema" manager, so both
managers' background commits (and their barriers) run at the same time.
Neither manager is given a `name`, so their barrier prefixes come from their
directories. Every barrier key each manager uses is recorded through the
injectable `coordinator=` (which forwards to the real one). Prints the digests
taken at every step, the steps each manager lists, the digests of every step
restored, and the recorded barrier keys.
"""

import sys

import _topology as topo

topo.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax

import flax_ckpt_plugin
from flax_ckpt_plugin.multihost import coordinator
from flax_ckpt_plugin import Processes

NUM_STEPS = 4
MESH = (2, 2)


class RecordingCoordinator(coordinator.JaxCoordinator):
  """The real coordinator, remembering every barrier key it met at."""

  def __init__(self):
    super().__init__()
    self.keys = []

  def barrier(self, key: str, **kwargs) -> None:
    self.keys.append(key)
    super().barrier(key, **kwargs)


def main(train_dir: str, ema_dir: str) -> dict:
  mesh = topo.make_mesh(MESH)
  state = topo.init_state(mesh)
  train_step = topo.make_train_step(mesh)
  param_sh = jax.tree.map(lambda a: a.sharding, state.params)
  ema_update = jax.jit(
      lambda ema, params: jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, ema,
                                       params),
      out_shardings=param_sh, donate_argnums=0)
  ema = jax.tree.map(lambda p: p * 1.0, state.params)
  barriers = {"train": RecordingCoordinator(),
              "ema": RecordingCoordinator()}
  train = flax_ckpt_plugin.CheckpointManager(
      train_dir, max_to_keep=None,
      processes=Processes(barrier_timeout_secs=60,
                          coordinator=barriers["train"]))
  ema_mgr = flax_ckpt_plugin.CheckpointManager(
      ema_dir, max_to_keep=None,
      processes=Processes(barrier_timeout_secs=60, coordinator=barriers["ema"]))
  saved = {"train": {}, "ema": {}}
  for step in range(1, NUM_STEPS + 1):
    state = train_step(state)
    ema = ema_update(ema, state.params)
    train.save(step, state)
    ema_mgr.save(step, ema)
    # Taken before the next step donates these buffers.
    saved["train"][step] = topo.leaf_digests(state)
    saved["ema"][step] = topo.leaf_digests(ema)
  train.wait_until_finished()
  ema_mgr.wait_until_finished()
  train_target = topo.abstract_state(mesh, topo.SPECS)
  ema_target = train_target.params
  restored = {"train": {}, "ema": {}}
  for step in range(1, NUM_STEPS + 1):
    restored["train"][step] = topo.leaf_digests(
        train.restore(train_target, step=step))
    restored["ema"][step] = topo.leaf_digests(
        ema_mgr.restore(ema_target, step=step))
  result = {
      "names": {"train": train.name, "ema": ema_mgr.name},
      "all_steps": {"train": train.all_steps(), "ema": ema_mgr.all_steps()},
      "saved": saved,
      "restored": restored,
      "barrier_keys": {k: b.keys for k, b in barriers.items()},
  }
  train.close()
  ema_mgr.close()
  return result


if __name__ == "__main__":
  topo.emit(main(sys.argv[1], sys.argv[2]))
