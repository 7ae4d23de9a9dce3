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

A SIGTERM to any one process is a preemption notice for all: JAX's notifier
tells every process, all save the same step, and each exits with code 75
(`PREEMPTED_EXIT_CODE`) once that checkpoint is durable. Batches are a pure
function of the step, so a rerun resumes exactly.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def launch(args: argparse.Namespace, script: str = __file__, *,
           heartbeat_timeout: int = 100) -> int:
  """Starts `args.launch` copies of `script` as one jax.distributed job.

  Prints each process's pid, so that one of them can be sent a signal, and
  each one's exit code. A SIGTERM to this launcher is passed on to every
  process, as a scheduler would send it. With `args.relaunch`, a process
  that a signal killed is started again once (without its `--kill-*`
  arguments), as a scheduler replacing a lost machine would: any process
  with `args.coordinator_process` (the coordination service then runs in
  a process of its own, `flax-ckpt coordinator`, started first with
  `heartbeat_timeout`), else any but 0 (whose death ends the job).
  Returns the common exit code of the processes, or 1 if they differ.
  """
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  service = None
  if getattr(args, "coordinator_process", False):
    service = subprocess.Popen(
        [sys.executable, "-m", "flax_ckpt_plugin", "coordinator", "--port",
         str(port), "--num-processes", str(args.launch),
         "--heartbeat-timeout", str(heartbeat_timeout)],
        stdout=subprocess.PIPE, text=True)
    for line in service.stdout:  # Its first line says it listens.
      print(line, end="", flush=True)
      if "listens on" in line:
        break
    print(f"coordinator: pid {service.pid}", flush=True)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count="
             f"{args.devices_per_process}", JAX_PLATFORMS="cpu")
  argv = [a for a in sys.argv[1:]]
  i = argv.index("--launch")
  del argv[i:i + 2]

  def start(p, argv=argv):
    proc = subprocess.Popen(
        [sys.executable, script, *argv, "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", str(args.launch), "--process-id", str(p)],
        env=env)
    print(f"process {p}: pid {proc.pid}", flush=True)
    return proc

  procs = [start(p) for p in range(args.launch)]

  def forward(signum, frame):
    del frame
    for proc in procs:
      if proc.poll() is None:
        proc.send_signal(signum)

  signal.signal(signal.SIGTERM, forward)
  codes: dict[int, int] = {}
  relaunch = {p for p in range(0 if service else 1, args.launch)
              if args.relaunch}
  while len(codes) < len(procs):
    for p, proc in enumerate(procs):
      code = proc.poll()
      if p in codes or code is None:
        continue
      code = code if code >= 0 else 128 - code  # Killed by signal N: 128 + N.
      print(f"process {p} exited with code {code}", flush=True)
      if code > 128 and p in relaunch:
        relaunch.discard(p)
        procs[p] = start(p, [a for i, a in enumerate(argv) if not (
            a.startswith("--kill") or i and argv[i - 1].startswith("--kill"))])
      else:
        codes[p] = code
    time.sleep(0.05)
  if service is not None:  # The job ended: so does its service.
    service.terminate()
    try:
      service.wait(30)
    except subprocess.TimeoutExpired:
      service.kill()
  return codes[0] if len(set(codes.values())) == 1 else 1


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
  """--launch N, and what `launch` tells each process it starts."""
  parser.add_argument("--launch", type=int, default=0,
                      help="start this many local processes")
  parser.add_argument("--devices-per-process", type=int, default=2)
  parser.add_argument("--coordinator", default="")
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--relaunch", action="store_true",
                      help="with --launch: start a killed process again")
  parser.add_argument("--coordinator-process", action="store_true",
                      help="run JAX's coordination service in a process of"
                      " its own (flax-ckpt coordinator), so that any"
                      " process, 0 included, may die and the others go on")


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
  from flax_ckpt_plugin import PREEMPTED_EXIT_CODE  # pylint: disable=g-import-not-at-top

  # A 2-D mesh: 'data' across processes, 'model' within each.
  n_proc = jax.process_count()
  mesh = Mesh(np.array(jax.devices()).reshape(n_proc, -1), ("data", "model"))

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(256)(x))
      return nn.Dense(8)(x)

  # Made once: a TrainState's apply_fn and tx are its pytree metadata, and
  # JAX pairs two trees (out_shardings and the state) only when those are
  # the same objects.
  model, tx = MLP(), optax.adam(1e-3)

  def create():
    params = model.init(jax.random.key(0), jnp.ones((1, 32)))
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=tx)

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
    loss = float("nan")
    for step in range(start + 1, args.num_steps + 1):
      t0 = time.monotonic()
      state, loss = train_step(state, *batch(step))
      # Wait for the step on every process: with steps dispatched far ahead,
      # the CPU (gloo) collectives of this example hung after ~100 steps.
      loss = float(loss)
      cb(step, state, metrics={"loss": loss})
      if (args.log_every and step % args.log_every == 0
          and jax.process_index() == 0):
        print(f"step {step}: loss {loss:.5f}", flush=True)
      if cb.should_stop:  # Every process stops at the same step.
        break
      if args.step_secs:
        time.sleep(max(0.0, t0 + args.step_secs - time.monotonic()))
  # The callback is closed: the preemption checkpoint (if any) is durable.
  if cb.should_stop:
    print(f"process {jax.process_index()}: preempted: checkpoint of step"
          f" {step} is durable, exiting with code {PREEMPTED_EXIT_CODE}",
          flush=True)
    sys.exit(PREEMPTED_EXIT_CODE)
  if args.final_params:
    save_final_params(args.final_params, state)
  if jax.process_index() == 0:
    print(f"done at step {int(state.step)}, loss {loss:.5f}", flush=True)


def save_final_params(path: str, state) -> None:
  """Process 0 writes every leaf's global value to an .npz, by key path.

  Called on every process: gathering the shards of the others is a
  collective.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  values = multihost_utils.process_allgather([v for _, v in leaves],
                                             tiled=True)
  if jax.process_index() == 0:
    np.savez(path, **{jax.tree_util.keystr(k): np.asarray(v)
                      for (k, _), v in zip(leaves, values)})


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="/tmp/flax_ckpt_plugin_multihost")
  parser.add_argument("--num-steps", type=int, default=40)
  parser.add_argument("--every-steps", type=int, default=10)
  parser.add_argument("--log-every", type=int, default=0,
                      help="process 0 prints the loss every this many steps")
  parser.add_argument("--step-secs", type=float, default=0.0,
                      help="make every step last at least this long, as a"
                      " bigger model's would (to try preemption by hand)")
  parser.add_argument("--final-params", default=None,
                      help="process 0 writes the final state's leaves to"
                      " this .npz")
  add_launch_arguments(parser)
  args = parser.parse_args()
  if args.launch:
    sys.exit(launch(args))
  train(args)


if __name__ == "__main__":
  main()
