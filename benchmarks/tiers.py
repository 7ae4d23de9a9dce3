"""The local tier: what it costs the train loop, and a restore from each tier.

    python benchmarks/tiers.py                     # ~1 GB TrainState
    python benchmarks/tiers.py --layers 2 --width 256 --pairs 2 \\
        --restores 1 --json /tmp/t.json            # seconds, for CI

One process with 2 CPU devices trains bench.py's TrainState (`--layers`
Dense layers of `--width`^2 float32, Adam, a donating jitted step whose loss
is read each step):

1. loop cost: `--pairs` pairs of blocks of `--local-every` steps, one
   with the callback and its local tier every `--local-every` steps (on
   `--local-dir`, /dev/shm by default; the persistent tier saves nothing),
   so one local save at the block's first step and the wait for it at its
   end, one without checkpoints; the blocks alternate (ABBA...), so the
   two halves share the machine's drift. After a warm-up of 3 local saves
   (a long run's steady state), with one callback throughout. The cost is
   the total time with saves over the total time without, minus 1; the
   median and quartiles of the pairs show the spread, and the same ratio
   of the process's CPU time (all threads), which the other tenants of a
   shared machine disturb less;
2. restores of one step, the files warm in the page cache: from the local
   tier and from the persistent tier (`--dir`, a disk) through
   `CheckpointCallback.restore_or_initialize`, and Orbax restoring the
   same step that it saved to the same disk; medians of `--restores`. Also
   whether the local restore read anything from the persistent tier.

Then `--processes` processes (0 skips this), 2 CPU devices each, hold a
state of the same size split over each process's devices and replicated
across processes (data parallelism). They save one step to both tiers,
then restore it, each restore from new callbacks, from: every process's
local tier; peers (the last process's local tier moved away: it gets its
shards over JAX collectives); the persistent tier (every local tier moved
away). The slowest process's time counts; every restore is checked bit
for bit.

Prints a table; `--json` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import bench
import scaling
from flax_ckpt_plugin import FaultTolerance


def _loop(state, train_step, steps, cb=None, first=1, cpu=None):
  t0, c0 = time.perf_counter(), time.process_time()
  for step in range(first, first + steps):
    state, loss = train_step(state)
    float(loss)  # A loop that logs its loss waits for each step.
    if cb is not None:
      cb(step, state)
  if cb is not None:
    cb.wait_until_finished()
  if cpu is not None:  # All threads' CPU time: the VM's steal is not in it.
    cpu.append(time.process_time() - c0)
  return time.perf_counter() - t0, state


def one_process(args: argparse.Namespace) -> dict:
  """1 and 2 of the module doc."""
  state, train_step = bench.build(args)
  import jax  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin import CheckpointCallback  # pylint: disable=g-import-not-at-top
  root = tempfile.mkdtemp(dir=args.dir)
  local = tempfile.mkdtemp(dir=args.local_dir)
  out = {"state_bytes": sum(a.nbytes for a in jax.tree.leaves(state))}
  try:
    # One callback throughout, as in a long run: its first saves (new
    # staging memory, new files) happen in a warm-up before the pairs.
    k = args.local_every
    cb = CheckpointCallback(
        os.path.join(root, "loop"),
        tolerance=FaultTolerance(local_directory=os.path.join(local, "loop"),
                                 local_every_steps=k))
    _, state = _loop(state, train_step, 3 * k, cb, first=k)
    first = 4 * k  # Each block with saves starts at a multiple of k.
    with_saves, without, cpu_with, cpu_without = [], [], [], []
    for i in range(args.pairs):
      order = (True, False) if i % 2 == 0 else (False, True)
      for saving in order:
        if saving:
          t, state = _loop(state, train_step, k, cb, first, cpu_with)
          first += k
          with_saves.append(t)
        else:
          t, state = _loop(state, train_step, k, cpu=cpu_without)
          without.append(t)
    cb.close()
    shutil.rmtree(os.path.join(local, "loop"), ignore_errors=True)
    ratios = sorted(a / b - 1 for a, b in zip(with_saves, without))
    out.update(loop_secs_with_saves=with_saves, loop_secs_without=without,
               loop_overhead_pairs=ratios,
               loop_overhead=sum(with_saves) / sum(without) - 1,
               loop_cpu_secs_with_saves=cpu_with,
               loop_cpu_secs_without=cpu_without,
               loop_cpu_overhead=sum(cpu_with) / sum(cpu_without) - 1,
               loop_overhead_median=statistics.median(ratios),
               loop_overhead_quartiles=statistics.quantiles(ratios, n=4)
               if len(ratios) > 1 else ratios * 3)

    # 2: one step in both tiers (ours) and in Orbax's format.
    directory = os.path.join(root, "restore")
    tiers = {"tolerance": FaultTolerance(
        local_directory=os.path.join(local, "restore"), local_every_steps=1)}
    with CheckpointCallback(directory, every_steps=1, **tiers) as cb:
      cb(1, state)
    open_orbax, save_orbax, restore_orbax = scaling.system("orbax")
    orbax = open_orbax(os.path.join(root, "orbax"))
    save_orbax(orbax, 1, state)
    orbax.wait_until_finished()
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        state)
    expected = scaling._digests(state)  # pylint: disable=protected-access
    del state
    ways = {
        "local": lambda: CheckpointCallback(directory, **tiers),
        "persistent": lambda: CheckpointCallback(directory),
    }
    for _ in range(args.restores + 1):  # The first warms the page cache.
      for name, make in ways.items():
        cb = make()
        t = time.perf_counter()
        restored = jax.block_until_ready(cb.restore_or_initialize(target))
        secs = time.perf_counter() - t
        assert cb.restored_tier == name, (name, cb.restored_tier)
        assert scaling._digests(restored) == expected, name  # pylint: disable=protected-access
        if name == "local":
          out["local_restore_read_persistent"] = (
              cb.manager.last_restore_stats is not None)
        out.setdefault(f"{name}_restore_secs", []).append(secs)
        cb.close()
        del restored
      t = time.perf_counter()
      restored = jax.block_until_ready(restore_orbax(orbax, 1, target))
      out.setdefault("orbax_restore_secs", []).append(
          time.perf_counter() - t)
      assert scaling._digests(restored) == expected, "orbax"  # pylint: disable=protected-access
      del restored
    orbax.close()
    for name in ("local", "persistent", "orbax"):
      del out[f"{name}_restore_secs"][0]
  finally:
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
  return out


def process_worker(args: argparse.Namespace) -> dict:
  """One process of the multi-process part (see the module doc)."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  pid, n = int(os.environ["PROCESS_ID"]), int(os.environ["NUM_PROCESSES"])
  jax.distributed.initialize(f"127.0.0.1:{os.environ['PORT']}",
                             num_processes=n, process_id=pid)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin import CheckpointCallback  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(n, 2),
                           ("data", "model"))
  sharding = NamedSharding(mesh, P("model", None))
  make = jax.jit(lambda k: {
      name: [jax.random.normal(jax.random.fold_in(k, i), (args.width,) * 2)
             for i in range(args.layers)] for name in ("params", "mu", "nu")},
                 out_shardings=sharding)
  state = make(jax.random.key(0))
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state)
  mine = [np.asarray(s.data) for x in jax.tree.leaves(state)
          for s in x.addressable_shards]
  directory = os.path.join(args.dir, "ckpt")
  local = os.path.join(args.local_dir, f"local_{pid}")
  tiers = {"tolerance": FaultTolerance(local_directory=local,
                                       local_every_steps=1)}
  with CheckpointCallback(directory, every_steps=1, **tiers) as cb:
    cb(1, state)
  del state
  out = {"process": pid, "state_bytes": sum(
      x.size * 4 for x in jax.tree.leaves(target))}
  for _ in range(args.restores + 1):
    for name, away in (("local", ()), ("peer", (n - 1,)),
                       ("persistent", tuple(range(n)))):
      if pid in away:
        os.rename(local, local + ".away")
      multihost_utils.sync_global_devices(f"{name} start")
      cb = CheckpointCallback(directory, **tiers)
      t = time.perf_counter()
      restored = jax.block_until_ready(cb.restore_or_initialize(target))
      secs = time.perf_counter() - t
      assert cb.restored_tier == name, (name, cb.restored_tier)
      got = [np.asarray(s.data) for x in jax.tree.leaves(restored)
             for s in x.addressable_shards]
      assert all(np.array_equal(a, b) for a, b in zip(got, mine)), name
      out.setdefault(f"{name}_restore_secs", []).append(secs)
      cb.close()
      del restored, got
      multihost_utils.sync_global_devices(f"{name} end")
      if pid in away:
        shutil.rmtree(local, ignore_errors=True)  # The callback made it.
        os.rename(local + ".away", local)
  for name in ("local", "peer", "persistent"):
    del out[f"{name}_restore_secs"][0]  # The first warms the page cache.
  return out


def processes(args: argparse.Namespace, passthrough: list[str]) -> list[dict]:
  """The multi-process part: `--processes` workers of this script."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  root = tempfile.mkdtemp(dir=args.dir)
  local = tempfile.mkdtemp(dir=args.local_dir)
  procs = []
  try:
    for pid in range(args.processes):
      env = dict(os.environ, PROCESS_ID=str(pid), PORT=str(port),
                 NUM_PROCESSES=str(args.processes))
      procs.append(subprocess.Popen(
          [sys.executable, __file__, *passthrough, "--worker", "--dir", root,
           "--local-dir", local], env=env, stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=3600) for p in procs]
  finally:
    for p in procs:
      p.kill()
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
  if any(p.returncode for p in procs):
    sys.exit("a process failed:\n" + "\n".join(e[-3000:] for _, e in outs))
  return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def main() -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--width", type=int, default=3200)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--local-every", type=int, default=10)
  parser.add_argument("--pairs", type=int, default=40)
  parser.add_argument("--restores", type=int, default=3)
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--dir", default=None, help="the persistent tier's"
                      " disk (default: a temp dir)")
  parser.add_argument("--local-dir", default="/dev/shm",
                      help="the local tier's path")
  parser.add_argument("--json", default=None, help="write all figures here")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    print(json.dumps(process_worker(args)))
    return
  passthrough = [a for a in sys.argv[1:]]
  for flag in ("--json", "--dir", "--local-dir"):
    if flag in passthrough:
      i = passthrough.index(flag)
      del passthrough[i:i + 2]
  result = {"one_process": one_process(args)}
  if args.processes:
    result["processes"] = processes(args, passthrough)
  med = statistics.median
  one = result["one_process"]
  print(f"state {one['state_bytes'] / 1e9:.2f} GB; local tier on"
        f" {args.local_dir}, persistent tier on {args.dir or tempfile.gettempdir()}")
  q1, _, q3 = one["loop_overhead_quartiles"]
  print(f"loop, local tier every {args.local_every} steps:"
        f" {one['loop_overhead']:+.1%} ({args.pairs} pairs of"
        f" {args.local_every}-step blocks; per pair median"
        f" {one['loop_overhead_median']:+.1%}, quartiles {q1:+.1%}"
        f" {q3:+.1%}); CPU time {one['loop_cpu_overhead']:+.1%}")
  print("restore of one step, warm, median (s): local"
        f" {med(one['local_restore_secs']):.3f}, persistent"
        f" {med(one['persistent_restore_secs']):.3f}, Orbax"
        f" {med(one['orbax_restore_secs']):.3f};"
        " local/Orbax"
        f" {med(one['local_restore_secs']) / med(one['orbax_restore_secs']):.2f};"
        " the local restore read the persistent tier:"
        f" {one['local_restore_read_persistent']}")
  if args.processes:
    summary = {name: med([max(p[f"{name}_restore_secs"][i]
                              for p in result["processes"])
                          for i in range(args.restores)])
               for name in ("local", "peer", "persistent")}
    result["processes_summary"] = summary
    print(f"{args.processes} processes, each holding the"
          f" {result['processes'][0]['state_bytes'] / 1e9:.2f} GB state"
          " (replicated across them), slowest process, median (s): "
          + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), **result}, f, indent=1)


if __name__ == "__main__":
  main()
