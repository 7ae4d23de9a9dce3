"""Trains a small MLP with Flax and Optax, checkpointing with flax_ckpt_plugin.

The data is synthetic and deterministic: points from a fixed random seed,
labelled by a random linear "teacher". The data loader shuffles every epoch
with a host numpy RNG; its position (epoch, batch index, RNG state) is saved
with each checkpoint as `extra`, so a resumed run sees exactly the batches an
uninterrupted run would have seen.

    python examples/train.py --num-steps 100
    python examples/train.py --num-steps 200   # resumes from step 100

On SIGTERM (a preemption notice) it saves the current step, waits until that
checkpoint is durable, and exits with code 75 (`PREEMPTED_EXIT_CODE`); run it
again and it resumes from there. Delete the workdir (default
/tmp/flax_ckpt_plugin_example) to start over.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from flax import linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import PREEMPTED_EXIT_CODE

NUM_FEATURES = 16
NUM_CLASSES = 4
NUM_EXAMPLES = 1024
BATCH_SIZE = 32
DATA_SEED = 0


def make_dataset(seed: int = DATA_SEED) -> tuple[np.ndarray, np.ndarray]:
  """Inputs from N(0, 1), labels from a random linear teacher."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((NUM_EXAMPLES, NUM_FEATURES)).astype(np.float32)
  teacher = rng.standard_normal((NUM_FEATURES, NUM_CLASSES))
  y = np.argmax(x @ teacher, axis=-1).astype(np.int32)
  return x, y


class Loader:
  """Endless shuffled batches whose position can be saved and restored."""

  def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int,
               seed: int):
    self.x, self.y = x, y
    self.batch_size = batch_size
    self.batches_per_epoch = len(x) // batch_size
    self.rng = np.random.default_rng(seed)
    self.epoch = 0
    self._start_epoch()

  def _start_epoch(self) -> None:
    # The RNG state before this epoch's shuffle is enough to redo it.
    self._epoch_rng_state = self.rng.bit_generator.state
    self._order = self.rng.permutation(len(self.x))
    self.batch = 0

  def next(self) -> tuple[np.ndarray, np.ndarray]:
    if self.batch == self.batches_per_epoch:
      self.epoch += 1
      self._start_epoch()
    idx = self._order[self.batch * self.batch_size:
                      (self.batch + 1) * self.batch_size]
    self.batch += 1
    return self.x[idx], self.y[idx]

  def position(self) -> dict[str, Any]:
    """JSON-serializable position: the next batch is the one after it."""
    return {"epoch": self.epoch, "batch": self.batch,
            "rng": self._epoch_rng_state}

  def restore(self, position: dict[str, Any]) -> None:
    self.rng.bit_generator.state = position["rng"]
    self.epoch = position["epoch"]
    self._start_epoch()
    self.batch = position["batch"]


class MLP(nn.Module):
  hidden: int = 64

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden)(x))
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(NUM_CLASSES)(x)


def create_state(seed: int = 0) -> train_state.TrainState:
  model = MLP()
  # Jitted: one compilation instead of one per initializer op.
  params = jax.jit(model.init)(jax.random.key(seed),
                               jnp.zeros((1, NUM_FEATURES)))
  return train_state.TrainState.create(
      apply_fn=model.apply, params=params["params"], tx=optax.adam(1e-3))


def train_step(state: train_state.TrainState, x: jax.Array,
               y: jax.Array) -> tuple[train_state.TrainState, jax.Array]:
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


# The step donates its input state: the checkpoint library has taken its own
# snapshot by the time `cb(...)` returns, so donation is safe.
train_step = jax.jit(train_step, donate_argnums=0)


def save_final_params(path: str, state: train_state.TrainState) -> None:
  """Writes every leaf of the state to an .npz, keyed by its key path."""
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  np.savez(path, **{jax.tree_util.keystr(k): np.asarray(v)
                    for k, v in leaves})


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default="/tmp/flax_ckpt_plugin_example")
  parser.add_argument("--num-steps", type=int, default=100)
  parser.add_argument("--every-steps", type=int, default=20)
  parser.add_argument("--log-every", type=int, default=10,
                      help="print the loss every this many steps")
  parser.add_argument("--step-secs", type=float, default=0.0,
                      help="make every step last at least this long, as a"
                      " bigger model's would (to try preemption by hand)")
  parser.add_argument("--final-params", default=None,
                      help="write the final state's leaves to this .npz")
  args = parser.parse_args()

  x, y = make_dataset()
  loader = Loader(x, y, BATCH_SIZE, seed=1)
  state = create_state()

  cb = CheckpointCallback(args.workdir, every_steps=args.every_steps,
                          last_step=args.num_steps, max_to_keep=3)
  state = cb.restore_or_initialize(state)
  if cb.restored_step is None:
    print("no checkpoint, starting fresh", flush=True)
  else:
    loader.restore(cb.restored_extra)
    print(f"restored step {cb.restored_step}", flush=True)
  start = int(state.step)

  for step in range(start + 1, args.num_steps + 1):
    t0 = time.monotonic()
    bx, by = loader.next()
    state, loss = train_step(state, bx, by)
    cb(step, state, extra=loader.position(), metrics={"loss": loss})
    if step % args.log_every == 0:
      print(f"step {step}: loss {float(loss):.4f}", flush=True)
    if cb.should_stop:  # A preemption checkpoint of `step` is durable.
      cb.close()
      print(f"preempted: checkpoint of step {step} is durable, exiting with"
            f" code {PREEMPTED_EXIT_CODE}", flush=True)
      sys.exit(PREEMPTED_EXIT_CODE)
    if args.step_secs:
      time.sleep(max(0.0, t0 + args.step_secs - time.monotonic()))
  cb.close()  # Waits for the last save and raises any error it had.

  if args.final_params:
    save_final_params(args.final_params, state)
  print(f"done at step {int(state.step)}", flush=True)


if __name__ == "__main__":
  main()
