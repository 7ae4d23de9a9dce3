"""Trains a small Flax NNX model with Optax, checkpointing with flax_ckpt_plugin.

The model has `nnx.Linear`, `nnx.BatchNorm` and `nnx.Dropout` layers, so its
state holds parameters, batch statistics and the dropout RNG stream (a typed
PRNG key and a counter). Each checkpoint holds the model's and the
optimizer's `nnx.state` (parameters, batch statistics, RNG state, Adam's
moments and step count), and, as `extra`, the data loader's position. A
resumed run therefore sees the same batches and the same dropout masks, and
ends with the same bits, as an uninterrupted run.

    python examples/nnx_train.py --num-steps 100
    python examples/nnx_train.py --num-steps 200   # resumes from step 100

On SIGTERM (a preemption notice) it saves the current step, waits until that
checkpoint is durable, and exits with code 75 (`PREEMPTED_EXIT_CODE`); run it
again and it resumes from there. Delete the workdir (default
/tmp/flax_ckpt_plugin_nnx_example) to start over.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from flax import nnx
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
  """Endless shuffled batches; its position is two ints, saved as `extra`.

  Epoch `e` is shuffled by an RNG seeded with (seed, e), so the position
  alone is enough to redo the order.
  """

  def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int,
               seed: int):
    self.x, self.y = x, y
    self.batch_size = batch_size
    self.batches_per_epoch = len(x) // batch_size
    self.seed = seed
    self.restore({"epoch": 0, "batch": 0})

  def next(self) -> tuple[np.ndarray, np.ndarray]:
    if self.batch == self.batches_per_epoch:
      self.restore({"epoch": self.epoch + 1, "batch": 0})
    idx = self._order[self.batch * self.batch_size:
                      (self.batch + 1) * self.batch_size]
    self.batch += 1
    return self.x[idx], self.y[idx]

  def position(self) -> dict[str, Any]:
    """JSON-serializable position: the next batch is the one after it."""
    return {"epoch": self.epoch, "batch": self.batch}

  def restore(self, position: dict[str, Any]) -> None:
    self.epoch, self.batch = position["epoch"], position["batch"]
    rng = np.random.default_rng([self.seed, self.epoch])
    self._order = rng.permutation(len(self.x))


class MLP(nnx.Module):
  """Linear -> BatchNorm -> relu -> Dropout -> Linear."""

  def __init__(self, hidden: int = 64, *, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(NUM_FEATURES, hidden, rngs=rngs)
    self.bn = nnx.BatchNorm(hidden, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.linear2 = nnx.Linear(hidden, NUM_CLASSES, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.linear1(x)))
    return self.linear2(self.dropout(x))


def create(seed: int = 0) -> tuple[MLP, nnx.Optimizer]:
  model = MLP(rngs=nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  return model, optimizer


def checkpoint_state(model: MLP, optimizer: nnx.Optimizer) -> dict[str, Any]:
  """What a checkpoint holds: every Variable of the model and the optimizer.

  `nnx.state` includes the BatchNorm statistics and the dropout RNG stream,
  not only the parameters: without them a resumed run would draw other
  dropout masks than an uninterrupted one.
  """
  return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array,
               y: jax.Array) -> jax.Array:
  """One Adam step; updates `model` and `optimizer` in place."""
  def loss_fn(model):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def accuracy(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean(jnp.argmax(model(x), axis=-1) == y)


def save_final_state(path: str, state: Any) -> None:
  """Writes every leaf of the state to an .npz, keyed by its key path."""
  def host(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  np.savez(path, **{jax.tree_util.keystr(k): host(v) for k, v in leaves})


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default="/tmp/flax_ckpt_plugin_nnx_example")
  parser.add_argument("--num-steps", type=int, default=100)
  parser.add_argument("--every-steps", type=int, default=20)
  parser.add_argument("--log-every", type=int, default=10,
                      help="print the loss every this many steps")
  parser.add_argument("--step-secs", type=float, default=0.0,
                      help="make every step last at least this long, as a"
                      " bigger model's would (to try preemption by hand)")
  parser.add_argument("--final-state", default=None,
                      help="write the final state's leaves to this .npz")
  args = parser.parse_args()

  x, y = make_dataset()
  loader = Loader(x, y, BATCH_SIZE, seed=1)
  model, optimizer = create()

  cb = CheckpointCallback(args.workdir, every_steps=args.every_steps,
                          last_step=args.num_steps, max_to_keep=3)
  # The fresh state is the restore target: the checkpoint's values come back
  # with its types and on its devices, and `nnx.update` puts them in place.
  restored = cb.restore_or_initialize(checkpoint_state(model, optimizer))
  nnx.update(model, restored["model"])
  nnx.update(optimizer, restored["optimizer"])
  if cb.restored_step is None:
    print("no checkpoint, starting fresh", flush=True)
  else:
    loader.restore(cb.restored_extra)
    print(f"restored step {cb.restored_step}", flush=True)
  start = int(optimizer.step[...])

  for step in range(start + 1, args.num_steps + 1):
    t0 = time.monotonic()
    bx, by = loader.next()
    loss = train_step(model, optimizer, bx, by)
    cb(step, checkpoint_state(model, optimizer), extra=loader.position(),
       metrics={"loss": loss})
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

  if args.final_state:
    save_final_state(args.final_state, checkpoint_state(model, optimizer))
  model.eval()  # Running batch statistics, no dropout.
  print(f"accuracy {float(accuracy(model, x, y)):.4f}", flush=True)
  print(f"done at step {int(optimizer.step[...])}", flush=True)


if __name__ == "__main__":
  main()
