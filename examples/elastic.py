"""Train on several processes, go on without one that dies, take it back.

    python examples/elastic.py --launch 4 --kill-process 2 --kill-step 12 \
        --relaunch --step-secs 0.3 --num-steps 60

starts 4 local processes of 2 CPU devices each (as examples/multihost.py
does); process 2 SIGKILLs itself at step 12, as a lost machine would. The
other three notice (JAX's recoverability, a 3 s heartbeat), their step's
collective fails (CPU collectives time out after 10 s here), and
`cb.recover` restores the newest step of the local tier (every 3 steps, in
/dev/shm) on their 6 devices: they go on from there in the same processes,
saving to the persistent tier (every 10 steps) by themselves. With
`--relaunch` the launcher starts process 2 again, as a scheduler replacing
a machine would: its `restore_or_initialize` waits until the survivors
take it back (they set `cb.should_rebuild` at a step they agree on, and
call `cb.recover` again); it receives their state over collectives, and
all 4 go on on 8 devices and end with code 0. Without `--kill-*`, kill a
process by hand (`kill -9 PID`, with `--step-secs 0.5`).

With `--coordinator-process`, JAX's coordination service runs in a process
of its own (`flax-ckpt coordinator`), every process joins it with
`flax_ckpt_plugin.initialize`, and process 0 is a process like the others:

    python examples/elastic.py --launch 4 --coordinator-process \
        --kill-process 0 --kill-step 12 --relaunch --step-secs 0.3 \
        --num-steps 60

Without it, process 0 hosts the service, and losing it ends the job: run
it again and it resumes from the tiers.

The global batch stays the same on any number of devices: it is a function
of the step, split over the 'data' axis of whatever mesh is live (48 rows
divide over 8 devices and over 6).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from multihost import add_launch_arguments
from multihost import launch
from flax_ckpt_plugin import FaultTolerance

GLOBAL_BATCH = 48


def train(args: argparse.Namespace) -> None:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_collective_timeout_seconds=10")
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if args.coordinator_process:  # Every process a client only.
    import flax_ckpt_plugin  # pylint: disable=g-import-not-at-top
    flax_ckpt_plugin.initialize(args.coordinator, args.num_processes,
                                args.process_id, heartbeat_timeout_seconds=3)
  else:
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(args.coordinator, args.num_processes,
                               args.process_id, heartbeat_timeout_seconds=3)
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  from flax_ckpt_plugin import CheckpointCallback  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin import PREEMPTED_EXIT_CODE  # pylint: disable=g-import-not-at-top

  # Made once: a TrainState's apply_fn and tx are its pytree metadata, and
  # JAX pairs two trees (out_shardings and the state, a target and the
  # state) only when those are the same objects.
  model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(8)])
  tx = optax.adam(1e-3)

  def create():
    params = model.init(jax.random.key(0), jnp.ones((1, 32)))
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=tx)

  def make_target(devices):
    """The state's shapes on a data-parallel mesh of `devices`."""
    global mesh  # pylint: disable=global-variable-undefined
    mesh = Mesh(np.array(devices), ("data",))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
                        jax.eval_shape(create))

  @jax.jit
  def train_step(state, x, y):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean(
        (state.apply_fn(p, x) - y) ** 2))(state.params)
    return state.apply_gradients(grads=grads), loss

  def batch(step):  # The same global batch on every process, any mesh.
    rng = np.random.default_rng(step)
    x = rng.standard_normal((GLOBAL_BATCH, 32), dtype=np.float32)
    return (jax.make_array_from_callback(
        a.shape, NamedSharding(mesh, P("data")), lambda i, a=a: a[i])
            for a in (x, np.tanh(x[:, :8])))

  target = make_target(jax.devices())
  state = jax.jit(create, out_shardings=target.step.sharding)()
  cb = CheckpointCallback(
      args.workdir, every_steps=10, last_step=args.num_steps,
      tolerance=FaultTolerance(
          elastic=True, local_directory=f"{args.local_dir}/{args.process_id}",
          local_every_steps=3))
  # A relaunched process gets the survivors' state, on `make_target`'s mesh.
  state = cb.restore_or_initialize(state, make_target=make_target)
  step = int(state.step)
  while step < args.num_steps:
    try:
      for step in range(step + 1, args.num_steps + 1):
        if (args.process_id, step) == (args.kill_process, args.kill_step):
          os.kill(os.getpid(), signal.SIGKILL)  # A lost machine.
        state, loss = train_step(state, *batch(step))
        loss = float(loss)  # One step at a time on every process.
        cb(step, state, metrics={"loss": loss})
        if cb.should_stop:  # A preemption checkpoint is durable.
          cb.close()
          sys.exit(PREEMPTED_EXIT_CODE)
        if cb.should_rebuild:  # A relaunched process joins: all devices.
          state, step = cb.recover(make_target)
        time.sleep(args.step_secs)
    except Exception:  # pylint: disable=broad-except
      # A lost process: PeerLostError, or its collective's error. Go on
      # from the newest local step, on the live devices.
      state, step = cb.recover(make_target)
  cb.close()
  if jax.process_index() == 0:
    print(f"done at step {step} on {len(mesh.devices.flat)} devices, loss"
          f" {loss:.5f}", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="/tmp/flax_ckpt_plugin_elastic")
  parser.add_argument("--local-dir", default="/dev/shm/flax_ckpt_plugin_elastic",
                      help="the local tier: a per-host path (here per"
                      " process)")
  parser.add_argument("--num-steps", type=int, default=40)
  parser.add_argument("--kill-process", type=int, default=-1)
  parser.add_argument("--kill-step", type=int, default=-1)
  parser.add_argument("--step-secs", type=float, default=0.0,
                      help="pause after each step, as a bigger model would")
  add_launch_arguments(parser)
  args = parser.parse_args()
  if args.launch:
    sys.exit(launch(args, __file__, heartbeat_timeout=3))
  train(args)


if __name__ == "__main__":
  main()
