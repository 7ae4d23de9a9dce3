"""Train a sharded Flax model on several processes, checkpointing as it goes.

On a cluster, run this file once per host after the scheduler set up
`jax.distributed` (TPU VMs, SLURM and GKE are detected automatically):

    python examples/multihost.py --workdir gs://bucket/run1

To try it on one machine, `--launch N` starts N local processes, each with
`--devices-per-process` CPU devices, joined through 127.0.0.1:

    python examples/multihost.py --launch 2 --workdir /tmp/fcp_multihost

Run it again with a larger `--num-steps` and every process resumes from the
newest finalized step, even with another `--launch` count: the checkpoint is
restored into whatever mesh the new job has.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys


def launch(args: argparse.Namespace) -> int:
  """Starts `args.launch` copies of this script as one jax.distributed job."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count="
             f"{args.devices_per_process}", JAX_PLATFORMS="cpu")
  argv = [a for a in sys.argv[1:]]
  i = argv.index("--launch")
  del argv[i:i + 2]
  procs = [subprocess.Popen(
      [sys.executable, __file__, *argv, "--coordinator", f"127.0.0.1:{port}",
       "--num-processes", str(args.launch), "--process-id", str(p)], env=env)
           for p in range(args.launch)]
  return max(p.wait() for p in procs)


def train(args: argparse.Namespace) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  if args.coordinator:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes,
                               args.process_id)
  else:
    jax.distributed.initialize()  # Cluster auto-detection.
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  from flax_ckpt_plugin import CheckpointCallback  # pylint: disable=g-import-not-at-top

  # A 2-D mesh: 'data' across processes, 'model' within each.
  n_proc = jax.process_count()
  mesh = Mesh(np.array(jax.devices()).reshape(n_proc, -1), ("data", "model"))

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(256)(x))
      return nn.Dense(8)(x)

  model = MLP()

  def create():
    params = model.init(jax.random.key(0), jnp.ones((1, 32)))
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adam(1e-3))

  def spec(x):  # Matrices: rows over 'data', columns over 'model'.
    return P("data", "model") if x.ndim == 2 else P()

  shardings = jax.tree.map(lambda x: NamedSharding(mesh, spec(x)),
                           jax.eval_shape(create))
  state = jax.jit(create, out_shardings=shardings)()
  batch_sharding = NamedSharding(mesh, P("data"))

  @jax.jit
  def step_fn(state, x, y):
    def loss_fn(p):
      return jnp.mean((state.apply_fn(p, x) - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  train_step = jax.jit(step_fn, donate_argnums=0,
                       out_shardings=(shardings, None))

  def batch(step):  # The same global batch on every process, any mesh.
    rng = np.random.default_rng(step)
    x = rng.standard_normal((16 * n_proc, 32), dtype=np.float32)
    y = np.tanh(x[:, :8])
    return (jax.make_array_from_callback(a.shape, batch_sharding,
                                         lambda i, a=a: a[i]) for a in (x, y))

  with CheckpointCallback(args.workdir, every_steps=args.every_steps,
                          last_step=args.num_steps, max_to_keep=2) as cb:
    state = cb.restore_or_initialize(state)
    start = int(state.step)
    if jax.process_index() == 0:
      print(f"{n_proc} processes x {jax.local_device_count()} devices;"
            + (f" restored step {start}" if cb.restored_step is not None
               else " no checkpoint, starting fresh"), flush=True)
    for step in range(start + 1, args.num_steps + 1):
      state, loss = train_step(state, *batch(step))
      cb(step, state, metrics={"loss": loss})
      if cb.should_stop:
        break
  if jax.process_index() == 0:
    print(f"done at step {int(state.step)}, loss {float(loss):.5f}",
          flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="/tmp/flax_ckpt_plugin_multihost")
  parser.add_argument("--num-steps", type=int, default=40)
  parser.add_argument("--every-steps", type=int, default=10)
  parser.add_argument("--launch", type=int, default=0,
                      help="start this many local processes")
  parser.add_argument("--devices-per-process", type=int, default=2)
  parser.add_argument("--coordinator", default="")
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  args = parser.parse_args()
  if args.launch:
    sys.exit(launch(args))
  train(args)


if __name__ == "__main__":
  main()
