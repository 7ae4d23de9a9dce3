"""Trains a small Flax NNX model with Optax, checkpointing with flax_ckpt_plugin.

Laid out as Flax's NNX MNIST tutorial is: the train step mutates four NNX
objects, the model (parameters and `nnx.BatchNorm` statistics), the
`nnx.Optimizer` (Adam's moments and its step), an `nnx.MultiMetric` (the
running loss and accuracy) and the `nnx.Rngs` that `nnx.Dropout` draws its
masks from. Each checkpoint holds the state of all four (`nnx.state` of a
dict of them), and, as `extra`, the data loader's position. A resumed run
therefore sees the same batches, draws the same dropout masks, reports the
same running metrics, and ends with the same bits as an uninterrupted run.
Leave the `nnx.Rngs` out of the checkpoint and a resumed run draws the masks
of the first steps again (docs/nnx.md, "Save everything the train step
mutates").

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
  """Linear -> BatchNorm -> relu -> Dropout -> Linear.

  As in Flax's MNIST tutorial, `nnx.Dropout` holds no RNG stream of its own:
  the train step passes it an `nnx.Rngs`, an object apart from the model.
  """

  def __init__(self, hidden: int = 64, *, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(NUM_FEATURES, hidden, rngs=rngs)
    self.bn = nnx.BatchNorm(hidden, rngs=rngs)
    self.dropout = nnx.Dropout(0.1)
    self.linear2 = nnx.Linear(hidden, NUM_CLASSES, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = nnx.relu(self.bn(self.linear1(x)))
    return self.linear2(self.dropout(x, rngs=rngs))


def create(seed: int = 0) -> dict[str, Any]:
  """Every NNX object that `train_step` mutates, by name.

  The checkpoint is `nnx.state` of this dict, so it holds all four; a
  restore puts the values back with `nnx.update` of the same dict.
  """
  model = MLP(rngs=nnx.Rngs(seed))
  return {
      "model": model,
      "optimizer": nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
      "metrics": nnx.MultiMetric(loss=nnx.metrics.Average("loss"),
                                 accuracy=nnx.metrics.Accuracy()),
      "rngs": nnx.Rngs(dropout=seed + 1),
  }


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer,
               metrics: nnx.MultiMetric, rngs: nnx.Rngs, x: jax.Array,
               y: jax.Array) -> jax.Array:
  """One Adam step; updates all four objects in place.

  The model's batch statistics, the optimizer, the metrics and the dropout
  stream's counter all change here: that is why the checkpoint holds each.
  """
  def loss_fn(model, rngs):
    logits = model(x, rngs=rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, logits

  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model,
                                                                    rngs)
  optimizer.update(model, grads)
  metrics.update(loss=loss, logits=logits, labels=y)
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
                      help="print the mean loss and accuracy since the"
                      " last report every this many steps")
  parser.add_argument("--step-secs", type=float, default=0.0,
                      help="make every step last at least this long, as a"
                      " bigger model's would (to try preemption by hand)")
  parser.add_argument("--final-state", default=None,
                      help="write the final state's leaves to this .npz")
  args = parser.parse_args()

  x, y = make_dataset()
  loader = Loader(x, y, BATCH_SIZE, seed=1)
  train = create()
  model, optimizer, metrics, rngs = (
      train[k] for k in ("model", "optimizer", "metrics", "rngs"))

  cb = CheckpointCallback(args.workdir, every_steps=args.every_steps,
                          last_step=args.num_steps, max_to_keep=3)
  # The fresh state is the restore target: the checkpoint's values come back
  # with its types and on its devices, and `nnx.update` puts them in place,
  # into all four objects at once.
  nnx.update(train, cb.restore_or_initialize(nnx.state(train)))
  if cb.restored_step is None:
    print("no checkpoint, starting fresh", flush=True)
  else:
    loader.restore(cb.restored_extra)
    print(f"restored step {cb.restored_step}", flush=True)
  start = int(optimizer.step[...])

  for step in range(start + 1, args.num_steps + 1):
    t0 = time.monotonic()
    bx, by = loader.next()
    loss = train_step(model, optimizer, metrics, rngs, bx, by)
    if step % args.log_every == 0:
      # The means since the last report; reset before the save below, so
      # that the checkpoint of `step` holds what step + 1 starts from.
      report = metrics.compute()
      print(f"step {step}: loss {float(report['loss']):.4f} accuracy"
            f" {float(report['accuracy']):.4f}", flush=True)
      metrics.reset()
    cb(step, nnx.state(train), extra=loader.position(),
       metrics={"loss": loss})
    if cb.should_stop:  # A preemption checkpoint of `step` is durable.
      cb.close()
      print(f"preempted: checkpoint of step {step} is durable, exiting with"
            f" code {PREEMPTED_EXIT_CODE}", flush=True)
      sys.exit(PREEMPTED_EXIT_CODE)
    if args.step_secs:
      time.sleep(max(0.0, t0 + args.step_secs - time.monotonic()))
  cb.close()  # Waits for the last save and raises any error it had.

  if args.final_state:
    save_final_state(args.final_state, nnx.state(train))
  model.eval()  # Running batch statistics, no dropout.
  print(f"accuracy {float(accuracy(model, x, y)):.4f}", flush=True)
  print(f"done at step {int(optimizer.step[...])}", flush=True)

if __name__ == "__main__":
  main()
