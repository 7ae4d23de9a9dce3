"""Measures how long a preemption stop takes for a ~1 GB TrainState.

    python examples/preemption_timing.py --runs 3

Each run starts a training process (this script with `--child`) whose
TrainState holds 8 layers of 3200x3200 float32 with Adam's mu and nu (983 MB
in all), waits until it has trained a few steps, sends it SIGTERM, and
reports:

* notice -> durable: from the signal until the preemption checkpoint is
  finalized (the rest of the running step, the snapshot, writing and fsync of
  every byte, the commit), as seen by the training loop;
* notice -> exit: until the process has exited with code 75.

Then it prints the medians. This is how much grace (SLURM's `--signal` time,
Kubernetes' `terminationGracePeriodSeconds`) a job of this size needs on this
machine; see docs/preemption.md to scale it to yours.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from flax_ckpt_plugin import PREEMPTED_EXIT_CODE

LAYERS = 8
WIDTH = 3200
BATCH = 8
SIGNAL_AFTER_STEP = 3  # Past compilation: the loop runs at its own pace.
RUN_TIMEOUT_SECS = 600


def child(workdir: str) -> None:
  """Trains until SIGTERM; saves, reports when durable, exits with 75."""
  # pylint: disable=g-import-not-at-top
  import flax.linen as nn
  from flax.training import train_state
  import jax
  import jax.numpy as jnp
  import optax

  from flax_ckpt_plugin import CheckpointCallback

  class Tower(nn.Module):

    @nn.compact
    def __call__(self, x):
      for _ in range(LAYERS):
        x = nn.Dense(WIDTH, use_bias=False)(x)
      return x

  model = Tower()

  def create():
    params = model.init(jax.random.key(0), jnp.zeros((1, WIDTH)))
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adam(1e-4))

  def step_fn(state, x):
    def loss_fn(params):
      return jnp.mean(state.apply_fn(params, x) ** 2)
    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

  train_step = jax.jit(step_fn, donate_argnums=0)
  state = jax.jit(create)()
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
  # No regular saves: the only save is the one the notice triggers.
  cb = CheckpointCallback(workdir, max_to_keep=1)
  step = 0
  while True:
    step += 1
    t0 = time.perf_counter()
    state = train_step(state, x)
    cb(step, state)
    if cb.should_stop:
      durable = time.time()
      stats = cb.manager.last_save_stats
      cb.close()
      print(f"durable at {durable:.6f}: step {step}, {nbytes} bytes of state,"
            f" save blocked {stats.blocking_secs:.3f}s, commit"
            f" {stats.commit_secs:.3f}s", flush=True)
      sys.exit(PREEMPTED_EXIT_CODE)
    jax.block_until_ready(state)  # So a printed step is a finished step.
    print(f"step {step}: {time.perf_counter() - t0:.3f}s", flush=True)


def measure_once(workdir: str) -> dict[str, float]:
  """One run: SIGTERM after a few steps; seconds to durable and to exit."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("PYTHONUNBUFFERED", None)
  with tempfile.TemporaryFile() as stderr:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", "--workdir", workdir],
        stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
        start_new_session=True)
    # A hung child is killed, which ends the reads below.
    deadline = threading.Timer(RUN_TIMEOUT_SECS, os.killpg,
                               (proc.pid, signal.SIGKILL))
    deadline.start()
    try:
      lines = []
      for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"step {SIGNAL_AFTER_STEP}:"):
          last_step = line.strip()
          break
      sent = time.time()
      os.kill(proc.pid, signal.SIGTERM)
      lines += proc.stdout.readlines()
      code = proc.wait()
      exited = time.time()
    finally:
      deadline.cancel()
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    report = [l for l in lines if l.startswith("durable at ")]
    if code != PREEMPTED_EXIT_CODE or not report:
      stderr.seek(0)
      raise RuntimeError(
          f"exit code {code}, expected {PREEMPTED_EXIT_CODE} after a"
          f" 'durable' line\n{''.join(lines)}\n"
          f"{stderr.read().decode(errors='replace')[-8000:]}")
  durable = float(re.match(r"durable at ([\d.]+)", report[0])[1])
  print(f"  {last_step} (the last before the signal); {report[0].strip()}",
        flush=True)
  return {"durable": durable - sent, "exit": exited - sent}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--workdir", default=None,
                      help="where the checkpoints go (default: a temporary"
                      " directory, removed afterwards)")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    child(args.workdir)
    return

  print(f"{os.cpu_count()} CPU cores; {LAYERS} layers of {WIDTH}x{WIDTH}"
        " float32 with Adam", flush=True)
  results = []
  for i in range(args.runs):
    workdir = args.workdir or tempfile.mkdtemp(prefix="preemption_timing_")
    try:
      r = measure_once(os.path.join(workdir, f"run{i}"))
    finally:
      shutil.rmtree(os.path.join(workdir, f"run{i}"), ignore_errors=True)
      if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"run {i + 1}: notice -> durable {r['durable']:.2f}s, notice -> exit"
          f" {r['exit']:.2f}s", flush=True)
    results.append(r)
  print(f"median of {len(results)}: notice -> durable"
        f" {statistics.median(r['durable'] for r in results):.2f}s, notice ->"
        f" exit {statistics.median(r['exit'] for r in results):.2f}s",
        flush=True)


if __name__ == "__main__":
  main()
