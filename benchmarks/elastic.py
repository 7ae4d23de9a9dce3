"""How long the survivors of a lost process take to train again, in place,
and how long its replacement takes to rejoin them.

    python benchmarks/elastic.py                    # 4 processes, 5 trials
    python benchmarks/elastic.py --mb 64 --trials 3 --json /tmp/e.json
    python benchmarks/elastic.py --relaunch         # and take it back

Each trial starts `--processes` local processes of 2 CPU devices each (JAX
recoverability on, heartbeat `--heartbeat` s, CPU collectives timing out
after `--collective-timeout` s), training a data-parallel state of `--mb`
MB (a replicated Adam `TrainState`) with a callback made with
`elastic=True`: local tier on /dev/shm every 2 steps, persistent tier on
this machine's disk every 10. A random non-zero process SIGKILLs itself at
a random step; the survivors catch the failed step, call
`cb.recover(make_target)` and go on. Measured on each survivor, from the
kill: when `recover` returned, when the first step on the live devices
completed, and `recover`'s own time; the slowest survivor is reported.

What bounds it: a survivor stuck in the dead process's collective learns
of the death when that collective times out (or fails at once, when gloo
sees the connection drop); the watcher declares the process dead after the
heartbeat timeout. `recover` itself reads the local step from /dev/shm and
compiles nothing; the first step after it compiles the step for the new
mesh.

With `--relaunch`, once every survivor recovered, the killed process is
started again (the survivors pause `--degraded-step-secs` after each step
meanwhile, as a slower model would); measured from that relaunch, on the
new process: when `restore_or_initialize` returned its peers' state, and
when its first step completed; and on the survivors, `recover`'s time for
the rejoin. That span includes starting Python and JAX and connecting.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from flax_ckpt_plugin import FaultTolerance

BATCH = 48  # Divides over 8 and 6 devices.


def worker(args: argparse.Namespace) -> None:
  os.environ["XLA_FLAGS"] = (
      "--xla_force_host_platform_device_count=2"
      f" --xla_cpu_collective_timeout_seconds={args.collective_timeout}")
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_enable_recoverability", True)
  pid = int(os.environ["PROCESS_ID"])
  jax.distributed.initialize(
      f"127.0.0.1:{os.environ['PORT']}", args.processes, pid,
      heartbeat_timeout_seconds=args.heartbeat)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin import CheckpointCallback  # pylint: disable=g-import-not-at-top

  width = max(64, int((args.mb * 1e6 / 4 / 3) ** 0.5))
  tx = optax.adam(1e-3)

  def create():
    params = {"w": jnp.zeros((width, width)), "b": jnp.zeros((width,))}
    return train_state.TrainState.create(
        apply_fn=lambda p, x: x @ p["w"] + p["b"], params=params, tx=tx)

  mesh = None

  def make_target(devices):
    nonlocal mesh
    mesh = Mesh(np.array(devices), ("data",))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
                        jax.eval_shape(create))

  @jax.jit
  def step_fn(state, x):
    grads = jax.grad(lambda p: jnp.mean(
        (state.apply_fn(p, x) - x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  def batch(step):
    x = np.random.default_rng(step).standard_normal((BATCH, width),
                                                    np.float32)
    return jax.make_array_from_callback(
        x.shape, NamedSharding(mesh, P("data")), lambda i: x[i])

  target = make_target(jax.devices())
  state = jax.jit(create, out_shardings=target.step.sharding)()
  cb = CheckpointCallback(
      os.path.join(args.dir, "ckpt"), every_steps=10, max_to_keep=2,
      tolerance=FaultTolerance(
          local_directory=os.path.join(args.local, str(pid)),
          local_every_steps=2, elastic=True))
  state = cb.restore_or_initialize(state, make_target=make_target)
  out, step = {"process": pid}, int(state.step)
  if cb.restored_tier == "peer":  # Relaunched, and taken back.
    out.update(joined=time.time(), rejoined_at=step)
  killed_at = os.path.join(args.dir, "killed_at")
  while step < args.steps:
    try:
      for step in range(step + 1, args.steps + 1):
        if (pid == args.victim and step == args.kill_step
            and not os.path.exists(killed_at)):
          jax.block_until_ready(state)
          with open(killed_at, "w") as f:
            f.write(repr(time.time()))
          os.kill(os.getpid(), signal.SIGKILL)
        state = step_fn(state, batch(step))
        if ("recovered" in out or "joined" in out) and "first_step" not in out:
          jax.block_until_ready(state)
          out["first_step"] = time.time()
        cb(step, state)
        if cb.should_rebuild:
          t = time.time()
          state, step = cb.recover(make_target)
          out.update(rejoin_secs=time.time() - t, rejoined_at=step)
        elif args.relaunch and len(mesh.devices.flat) < 2 * args.processes:
          time.sleep(args.degraded_step_secs)
    except Exception:  # pylint: disable=broad-except
      t = time.time()
      state, step = cb.recover(make_target)
      out.update(recovered=time.time(), recover_secs=time.time() - t,
                 resumed_at=step)
      with open(os.path.join(args.dir, f"recovered_{pid}"), "w") as f:
        f.write("1")
  cb.close()
  if "joined" in out:
    with open(os.path.join(args.dir, "relaunched_at")) as f:
      start = float(f.read())
    out.update(joined=out["joined"] - start,
               first_step=out["first_step"] - start)
  else:
    with open(killed_at) as f:
      kill = float(f.read())
    out.update(recovered=out["recovered"] - kill,
               first_step=out["first_step"] - kill)
  print(json.dumps(out), flush=True)


def trial(args: argparse.Namespace, victim: int, kill_step: int) -> list:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  root = tempfile.mkdtemp(dir=args.dir)
  local = tempfile.mkdtemp(dir="/dev/shm", prefix="elastic_bench_")
  procs = []

  def start(pid):
    env = dict(os.environ, PROCESS_ID=str(pid), PORT=str(port))
    return subprocess.Popen(
        [sys.executable, __file__, "--worker", "--dir", root, "--local",
         local, "--victim", str(victim), "--kill-step", str(kill_step),
         *sys.argv[1:]], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)

  try:
    procs = [start(pid) for pid in range(args.processes)]
    if args.relaunch:  # Once the survivors recovered without it.
      end = time.monotonic() + args.timeout
      while time.monotonic() < end and not all(
          os.path.exists(os.path.join(root, f"recovered_{p}"))
          for p in range(args.processes) if p != victim):
        time.sleep(0.05)
      procs[victim].communicate(timeout=args.timeout)
      with open(os.path.join(root, "relaunched_at"), "w") as f:
        f.write(repr(time.time()))
      procs[victim] = start(victim)
    outs = [p.communicate(timeout=args.timeout) for p in procs]
  finally:
    for p in procs:
      p.kill()
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
  results = []
  for pid, (p, (o, e)) in enumerate(zip(procs, outs)):
    if pid == victim and not args.relaunch:
      continue
    if p.returncode:
      sys.exit(f"process {pid} ended with {p.returncode}:\n{e[-3000:]}")
    results.append(json.loads(o.strip().splitlines()[-1]))
  return results


def _table(title: str, rows: list[dict], columns: list[tuple[str, str]],
           summary: str) -> None:
  """Prints `rows` (columns: header, key), then the median and maximum of
  the last column, as `summary`."""
  print(title)
  print(" ".join(f"{h:>10}" for h, _ in columns))
  for r in rows:
    print(" ".join(f"{r[k]:>10.2f}" if isinstance(r[k], float)
                   else f"{r[k]:>10}" for _, k in columns))
  values = [r[columns[-2][1]] for r in rows]
  print(f"{summary}: median {statistics.median(values):.2f} s, max"
        f" {max(values):.2f} s")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=4)
  parser.add_argument("--mb", type=float, default=16.0)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--trials", type=int, default=5)
  parser.add_argument("--heartbeat", type=int, default=3)
  parser.add_argument("--collective-timeout", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dir", default=None)
  parser.add_argument("--json", default=None)
  parser.add_argument("--timeout", type=float, default=600)
  parser.add_argument("--relaunch", action="store_true",
                      help="start the killed process again; it rejoins")
  parser.add_argument("--degraded-step-secs", type=float, default=0.2)
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--local", help=argparse.SUPPRESS)
  parser.add_argument("--victim", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--kill-step", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.relaunch:  # Steps enough for the new process to start and join.
    args.steps = max(args.steps, 120)
  if args.worker:
    worker(args)
    return
  rng = random.Random(args.seed)
  rows = []
  for _ in range(args.trials):
    victim = rng.randrange(1, args.processes)
    kill_step = rng.randrange(5, 15 if args.relaunch else args.steps - 5)
    got = trial(args, victim, kill_step)
    new = [r for r in got if "joined" in r]
    got = [r for r in got if "joined" not in r]
    rows.append({
        "victim": victim, "kill_step": kill_step,
        "resumed_at": got[0]["resumed_at"],
        "recovered_secs": max(r["recovered"] for r in got),
        "first_step_secs": max(r["first_step"] for r in got),
        "recover_call_secs": max(r["recover_secs"] for r in got)})
    if new:
      rows[-1].update(
          rejoined_at=new[0]["rejoined_at"], joined_secs=new[0]["joined"],
          newcomer_first_step_secs=new[0]["first_step"],
          rejoin_call_secs=max(r["rejoin_secs"] for r in got))
  _table(f"{args.processes} processes x 2 CPU devices, {args.mb:g} MB"
         f" state, heartbeat {args.heartbeat} s, collective timeout"
         f" {args.collective_timeout} s; seconds from the kill (slowest"
         " survivor)", rows,
         [("victim", "victim"), ("killed at", "kill_step"),
          ("resumed at", "resumed_at"), ("recovered", "recovered_secs"),
          ("first step", "first_step_secs"),
          ("recover()", "recover_call_secs")],
         "first step after the kill")
  if args.relaunch:
    _table("the relaunched process, seconds from its relaunch; the"
           " survivors' recover() for the rejoin", rows,
           [("rejoined at", "rejoined_at"), ("state in", "joined_secs"),
            ("first step", "newcomer_first_step_secs"),
            ("recover()", "rejoin_call_secs")],
           "relaunch to the new process's first step")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
