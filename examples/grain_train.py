"""Train on a Grain pipeline, each process reading its own shard, and resume
exactly after a preemption.

    pip install "flax_ckpt_plugin[grain]"
    python examples/grain_train.py --workdir /tmp/fcp_grain
    python examples/grain_train.py --launch 2 --workdir /tmp/fcp_grain2
    python examples/grain_train.py --loader data_loader --worker-count 2 \\
        --launch 2 --workdir /tmp/fcp_grain3

Each process draws its own batches from an in-memory dataset through Grain:

* `--loader dataset` (the default): a `grain.MapDataset`, shuffled, mapped
  and batched, then sliced so that each process reads every
  `process_count`-th batch; its iterator's state is a dict;
* `--loader data_loader`: a `grain.DataLoader` with an `IndexSampler`
  (shuffled, sharded per process with `ShardOptions`) and `--worker-count`
  worker processes; its iterator's state is bytes.

`cb.restore_or_initialize(state, data_iterator=it)` gives each process's
iterator its saved state back, and every later save stores it,
so a rerun after a SIGTERM (exit code 75) draws exactly the batches the
uninterrupted run would have drawn, on every process, and ends with the
same parameters. The callback is called after the step that consumed the
batch and before the next batch is drawn. `--log-batches` prints a digest
of each process's batch at each step.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multihost  # pylint: disable=g-import-not-at-top,wrong-import-position

RECORDS, FEATURES, BATCH = 2048, 32, 16


def record(i: int):
  """Record i of the dataset: features and a target, a pure function of i."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  x = np.random.default_rng(i).standard_normal(FEATURES).astype(np.float32)
  return {"x": x, "y": np.tanh(x[:8])}


def data_iterator(args: argparse.Namespace, process: int, count: int):
  """This process's Grain iterator (see the module doc)."""
  import grain  # pylint: disable=g-import-not-at-top
  if args.loader == "dataset":
    ds = (grain.MapDataset.range(RECORDS).seed(args.seed).shuffle()
          .map(record).batch(BATCH, drop_remainder=True).repeat())
    return iter(ds[process::count])
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags.
    flags.FLAGS.mark_as_parsed()
  loader = grain.DataLoader(
      data_source=[record(i) for i in range(RECORDS)],
      sampler=grain.samplers.IndexSampler(
          RECORDS, shard_options=grain.sharding.ShardOptions(process, count),
          shuffle=True, num_epochs=None, seed=args.seed),
      operations=[grain.transforms.Batch(BATCH, drop_remainder=True)],
      worker_count=args.worker_count)
  return iter(loader)


def train(args: argparse.Namespace) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  if args.coordinator:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes,
                               args.process_id)
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  from flax_ckpt_plugin import CheckpointCallback  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin import PREEMPTED_EXIT_CODE  # pylint: disable=g-import-not-at-top

  me, n_proc = jax.process_index(), jax.process_count()
  mesh = Mesh(np.array(jax.devices()).reshape(n_proc, -1), ("data", "model"))

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8)(nn.relu(nn.Dense(64)(x)))

  # Made once: a TrainState's apply_fn and tx are its pytree metadata, and
  # JAX pairs two trees (out_shardings and the state) only when those are
  # the same objects.
  model, tx = MLP(), optax.adam(1e-3)

  def create():
    params = model.init(jax.random.key(0), jnp.ones((1, FEATURES)))
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=tx)

  shardings = jax.tree.map(lambda x: NamedSharding(mesh, P()),
                           jax.eval_shape(create))
  state = jax.jit(create, out_shardings=shardings)()
  batch_sharding = NamedSharding(mesh, P("data"))

  def step_fn(state, x, y):
    def loss_fn(p):
      return jnp.mean((state.apply_fn(p, x) - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  train_step = jax.jit(step_fn, donate_argnums=0,
                       out_shardings=(shardings, None))
  data = data_iterator(args, me, n_proc)

  with CheckpointCallback(args.workdir, every_steps=args.every_steps,
                          last_step=args.num_steps, max_to_keep=2) as cb:
    state = cb.restore_or_initialize(state, data_iterator=data)
    start = int(state.step)
    if me == 0:
      print(f"{n_proc} processes, loader {args.loader};"
            + (f" restored step {start}" if cb.restored_step is not None
               else " no checkpoint, starting fresh"), flush=True)
    loss = float("nan")
    for step in range(start + 1, args.num_steps + 1):
      t0 = time.monotonic()
      batch = next(data)  # This process's part of the global batch.
      if args.log_batches:
        digest = hashlib.sha1(batch["x"].tobytes()).hexdigest()[:16]
        print(f"process {me} step {step} batch {digest}", flush=True)
      x, y = (jax.make_array_from_process_local_data(batch_sharding, batch[k])
              for k in ("x", "y"))
      state, loss = train_step(state, x, y)
      loss = float(loss)
      cb(step, state)  # After the step that consumed the batch.
      if args.log_every and step % args.log_every == 0 and me == 0:
        print(f"step {step}: loss {loss:.5f}", flush=True)
      if cb.should_stop:
        break
      if args.step_secs:
        time.sleep(max(0.0, t0 + args.step_secs - time.monotonic()))
  if cb.should_stop:
    print(f"process {me}: preempted: checkpoint of step {step} is durable,"
          f" exiting with code {PREEMPTED_EXIT_CODE}", flush=True)
    sys.exit(PREEMPTED_EXIT_CODE)
  if args.final_params:
    multihost.save_final_params(args.final_params, state)
  if me == 0:
    print(f"done at step {int(state.step)}, loss {loss:.5f}", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="/tmp/flax_ckpt_plugin_grain")
  parser.add_argument("--loader", choices=("dataset", "data_loader"),
                      default="dataset")
  parser.add_argument("--worker-count", type=int, default=0,
                      help="the DataLoader's worker processes")
  parser.add_argument("--seed", type=int, default=7)
  parser.add_argument("--num-steps", type=int, default=40)
  parser.add_argument("--every-steps", type=int, default=10)
  parser.add_argument("--log-every", type=int, default=0)
  parser.add_argument("--log-batches", action="store_true")
  parser.add_argument("--step-secs", type=float, default=0.0)
  parser.add_argument("--final-params", default=None)
  multihost.add_launch_arguments(parser)
  args = parser.parse_args()
  if args.launch:
    sys.exit(multihost.launch(args, script=os.path.abspath(__file__)))
  train(args)


if __name__ == "__main__":
  main()
