"""Partner copies: what they cost the train loop beside a local tier
without them, and the bytes each process sends.

    python benchmarks/partners.py                  # 4 x 2 CPU devices
    python benchmarks/partners.py --layers 2 --width 256 --pairs 2 \\
        --json /tmp/p.json                         # seconds, for CI

`--processes` processes (2 CPU devices each, gloo) hold a state of
`--layers` x 3 (parameters and two moments) float32 matrices of
`--width`^2, each split by rows over every device (FSDP: no process holds
a replica of another's shards). A jitted step updates every leaf and
all-reduces a loss (read each step, as a loop that logs it). Blocks of
`--local-every` steps run in turn (ABC, BCA, CAB, ...), each `--pairs`
times: without checkpoints; with a callback whose local tier (on
`--local-dir`) saves at the block's first step (`replicas=0`); the same
with partner copies (`replicas=--replicas`). Each block ends by waiting
for its local save, so that the background work is counted in full.
After a warm-up of 2 saves of each callback.

Prints, on the slowest process: the loop overhead of each local tier over
the blocks without checkpoints (total time over total time, minus 1), the
ratio of the two overheads, the save call's median (the callback's call
at a save step), and the bytes each process sends per save against
`replicas` x its unique share of the state. `--json` writes every figure.
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


def sent_bytes(exchange, state) -> int:
  """The bytes this process sends as partner copies of `state`'s shards at
  each local-tier save: what `exchange`'s plan (`tolerance.exchange`) has
  it send, a block of the leaf per pair whose source device is its own."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  values, plan = exchange._plan(state)  # pylint: disable=protected-access
  me, total = jax.process_index(), 0
  for p in plan:
    x = values[p.at]
    block = int(np.prod(p.sharding.shard_shape(x.shape))) * x.dtype.itemsize
    flat = list(p.sharding.mesh.devices.flat)
    total += block * sum(flat[source].process_index == me
                         for pairs in p.pairs for source, _ in pairs)
  return total


def worker(args: argparse.Namespace) -> dict:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  pid, n = int(os.environ["PROCESS_ID"]), int(os.environ["NUM_PROCESSES"])
  jax.distributed.initialize(f"127.0.0.1:{os.environ['PORT']}",
                             num_processes=n, process_id=pid)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin import CheckpointCallback, FaultTolerance  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
  sharding = NamedSharding(mesh, P("fsdp", None))
  state = jax.jit(lambda k: {
      name: [jax.random.normal(jax.random.fold_in(k, i), (args.width,) * 2)
             for i in range(args.layers)] for name in ("params", "mu", "nu")},
                  out_shardings=sharding)(jax.random.key(0))

  def train(state):
    new = jax.tree.map(lambda x: x - 1e-3 * jnp.tanh(x), state)
    return new, sum(jnp.sum(x) for x in jax.tree.leaves(new))

  step = jax.jit(train, donate_argnums=0, out_shardings=(sharding, None))

  callbacks = {}
  for replicas in (0, args.replicas):
    callbacks[replicas] = CheckpointCallback(
        os.path.join(args.dir, f"ckpt{replicas}"), every_steps=10**9,
        tolerance=FaultTolerance(
            local_directory=os.path.join(args.local_dir,
                                         f"r{replicas}_{pid}"),
            local_every_steps=args.local_every, replicas=replicas))
  unique = sum(x.size * 4 for x in jax.tree.leaves(state)) // n
  exchange = callbacks[args.replicas].tiers.exchange
  send_secs = []
  send = exchange.send

  def timed_send(tree):  # The exchange's part of the save call.
    t = time.perf_counter()
    try:
      return send(tree)
    finally:
      send_secs.append(time.perf_counter() - t)

  exchange.send = timed_send
  sent = sent_bytes(exchange, state)
  blocks = [0]

  def block(cb):
    """`--local-every` steps, the first a multiple of it (a local save)."""
    nonlocal state
    blocks[0] += 1
    calls = []
    t0 = time.perf_counter()
    for i in range(args.local_every):
      state, loss = step(state)
      float(loss)
      if cb is not None:
        c = time.perf_counter()
        if cb(blocks[0] * args.local_every + i, state):
          calls.append(time.perf_counter() - c)
    if cb is not None:
      cb.tiers.wait_until_finished()
    return time.perf_counter() - t0, calls

  kinds = [None, 0, args.replicas]
  for kind in kinds[1:] * 2:  # Warm-up: compiles, first saves.
    block(callbacks[kind])
  times = {str(k): [] for k in kinds}
  calls = {str(k): [] for k in kinds}
  for i in range(args.pairs):
    for j in range(3):
      kind = kinds[(i + j) % 3]
      secs, c = block(None if kind is None else callbacks[kind])
      times[str(kind)].append(secs)
      calls[str(kind)].extend(c)
  for cb in callbacks.values():
    cb.close()
  return {"process": pid, "times": times, "calls": calls,
          "send_secs": send_secs[2:],
          "sent_bytes": sent, "unique_bytes": unique}


def main() -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--processes", type=int, default=4)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--local-every", type=int, default=5)
  parser.add_argument("--pairs", type=int, default=10)
  parser.add_argument("--replicas", type=int, default=1)
  parser.add_argument("--dir", default=None)
  parser.add_argument("--local-dir", default="/dev/shm")
  parser.add_argument("--json", default=None)
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    print(json.dumps(worker(args)))
    return
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  root = tempfile.mkdtemp(dir=args.dir)
  local = tempfile.mkdtemp(dir=args.local_dir)
  passthrough = [a for a in sys.argv[1:]]
  for flag in ("--json", "--dir", "--local-dir"):
    if flag in passthrough:
      i = passthrough.index(flag)
      del passthrough[i:i + 2]
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
  results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
  r = args.replicas
  total = {k: max(sum(p["times"][k]) for p in results)
           for k in results[0]["times"]}
  plain = total["None"]
  over = {k: total[k] / plain - 1 for k in ("0", str(r))}
  call = {k: statistics.median(c for p in results for c in p["calls"][k])
          for k in ("0", str(r))}
  sent = [p["sent_bytes"] / (r * p["unique_bytes"]) for p in results]
  summary = {"overhead_replicas0": over["0"], "overhead_partners": over[str(r)],
             "overhead_ratio": over[str(r)] / over["0"] if over["0"] > 0
             else None,
             "save_call_ms_replicas0": call["0"] * 1e3,
             "save_call_ms_partners": call[str(r)] * 1e3,
             "sent_over_replicas_x_share": sent}
  state_mb = results[0]["unique_bytes"] * args.processes / 1e6
  print(f"{args.processes} processes x 2 CPU devices, state {state_mb:.0f} MB"
        f" split over every device, local tier every {args.local_every}"
        f" steps on {args.local_dir}, {args.pairs} rounds")
  print(f"loop overhead: local tier {over['0']:+.1%}; with replicas={r}"
        f" {over[str(r)]:+.1%}; ratio "
        + ("n/a" if summary["overhead_ratio"] is None
           else f"{summary['overhead_ratio']:.2f}"))
  sends = statistics.median(s for p in results for s in p["send_secs"])
  summary["send_ms"] = sends * 1e3
  print(f"save call, median: {call['0'] * 1e3:.2f} ms without partners,"
        f" {call[str(r)] * 1e3:.2f} ms with, of which the exchange's"
        f" dispatch {sends * 1e3:.2f} ms")
  print("bytes sent per save / (replicas x unique share), per process: "
        + ", ".join(f"{x:.3f}" for x in sent))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "summary": summary,
                 "processes": results}, f, indent=1)


if __name__ == "__main__":
  main()
