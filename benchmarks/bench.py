"""flax_ckpt_plugin against Orbax on one Flax/Optax train loop, side by side.

    python benchmarks/bench.py                       # ~1 GB TrainState, 3 runs
    python benchmarks/bench.py --layers 2 --width 256 --steps 6 --every 3 \\
        --repeats 1 --json /tmp/bench.json           # seconds, for CI
    python benchmarks/bench.py --shape many          # model-like, see below

The state is a Flax `TrainState` of `--layers` Dense layers of
`--width` x `--width` float32 with Adam (8 x 3200 x 3200: ~0.98 GB), trained by
a jitted step that donates its state. Each system runs in its own process
(so peak RSS is its own), alternating which goes first, `--repeats` times.
Each run measures:

1. train-loop overhead: `--steps` steps with a save every `--every` steps
   (including the wait for the last save), against the mean of the same
   steps without saves run just before and just after; and the steady state:
   the same number of saves in the middle of each interval, so that every
   save's cost falls inside the measured steps, as in a long run. Each is
   run `--rounds` times, each time with a new manager, and every loop with
   saves sits between two loops without (the median over rounds counts);
2. blocking time of each save call;
3. one isolated save until durable, and a raw write + fsync of the same bytes
   with plain Python file I/O (the disk's ceiling, measured in the same run),
   and the disk's sustained direct-write rate (8 threads of direct writes
   from aligned memory, then fsync: machine.direct_write_gbps);
4. the restore right after the save of 3, in the saving process, into a
   target sharded over 2 CPU devices (ours takes the bytes from the
   snapshot the save still holds); then the warm restore (files in the
   page cache) into that target: the median of 3; and the train step
   right after each, against any other step (a step that cannot donate
   the restored arrays copies them first);
5. peak RSS of the process, and how far it rose above the train loop's own
   peak once checkpointing started;
6. the first restore in a fresh process, as a job makes it, of the step
   saved in 3, into the same target: once with the step's files dropped
   from the page cache (read from the disk) and once, in another fresh
   process, with them read into it first (our saves write with direct
   I/O, so they are not there otherwise); in that process, the floor:
   all cores filling new memory of the state's size at once;
7. limits of the machine that bound the figures above: how long new
   memory takes to touch for the first time (one core); how long deleting
   the file that the raw write of 3 made takes (retention deletes a step of
   that size after each save); and the restore floor, the time to fill new
   memory of the state's size, 4 KiB pages and huge pages, one thread's
   time divided by the cores, and all cores filling their shares at once
   (machine.py).

`--shape many|transformer|large` measures instead how first saves, later
saves, restores in a fresh process and RSS scale on model-like states
(scaling.py, shapes.py).

It prints medians with ratios (ours / Orbax, ours / ceiling) and writes all
figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import machine
import scaling
import shapes

SYSTEMS = scaling.SYSTEMS


def _rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _touch_secs_per_gb(nbytes: int) -> float:
  """Seconds per GB to touch new anonymous memory once, on one thread.

  Memory the runtime allocates costs this before any byte is written, so
  it bounds a restore that creates its arrays (and a first snapshot).
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  buf = mmap.mmap(-1, nbytes)
  view = np.frombuffer(buf, np.uint8)
  t = time.perf_counter()
  view[::mmap.PAGESIZE] = 1
  secs = time.perf_counter() - t
  del view
  buf.close()
  return secs / (nbytes / 1e9)


def model(args: argparse.Namespace):
  """A function that creates the benchmark's TrainState, and its donating
  train step (nothing is computed)."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(args.layers):
        x = nn.tanh(nn.Dense(args.width)(x))
      return x

  model = Model()
  x = jnp.ones((args.batch, args.width), jnp.float32)

  def create():
    params = model.init(jax.random.key(0), x)
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adam(1e-4))

  @jax.jit
  def step_fn(state):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean(state.apply_fn(p, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads), loss

  return create, jax.jit(step_fn, donate_argnums=0)


def build(args: argparse.Namespace):
  """The benchmark's TrainState (warmed up) and its donating train step."""
  import jax  # pylint: disable=g-import-not-at-top
  create, train_step = model(args)
  state = jax.jit(create)()
  for _ in range(2):  # Compile and warm up.
    state, loss = train_step(state)
    float(loss)
  return state, train_step


def _sharded_target(args: argparse.Namespace, create=None):
  """The restore target: the state's shapes, kernels split over the 2
  devices, the rest replicated."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()), ("x",))
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
          mesh, P("x") if a.ndim == 2 else P())),
      jax.eval_shape(create or model(args)[0]))


def _page_cache(directory: str, keep: bool) -> None:
  """Reads every file under `directory` once (`keep`: its pages are then
  in the page cache) or drops them from it."""
  for dirpath, _, names in os.walk(directory):
    for name in names:
      with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
        if keep:
          while f.read(64 << 20):
            pass
        else:
          os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def fresh_restore(args: argparse.Namespace) -> dict:
  """The first restore in a fresh process, as a job makes it, of the step
  the save process left: with its files in the page cache (`--phase
  fresh_restore`: they were read once first; the save wrote with direct
  I/O) or dropped from it (`fresh_restore_cold`: read from the disk). Then
  the floor of the same process: all cores filling new memory of the
  state's size at once."""
  import jax  # pylint: disable=g-import-not-at-top
  target = _sharded_target(args)
  directory = os.path.join(args.ckpt_root, "isolated")
  cold = args.phase == "fresh_restore_cold"
  _page_cache(directory, keep=not cold)
  open_manager, _, restore = scaling.system(args.worker)
  mngr = open_manager(directory)
  t = time.perf_counter()
  restored = restore(mngr, 1, target)
  jax.block_until_ready(restored)
  secs = time.perf_counter() - t
  mngr.close()
  nbytes = sum(a.nbytes for a in jax.tree.leaves(restored))
  restored = None
  key = "fresh_restore_cold_secs" if cold else "fresh_restore_secs"
  return {key: secs, f"{key[:-5]}_floor_parallel_secs":
          machine.parallel_fill_secs(nbytes)}


AB_MODES = {
    "pin": "snapshot only: numpy views that pin the state's buffers",
    "host_copy": "snapshot only: a blocking copy into reused host buffers",
    "enqueued_copy": "snapshot only: ours, a copy enqueued on the device",
    "save_page_cache": "whole save, data written through the page cache",
    "save_direct": "whole save, ours: large shards written with O_DIRECT",
}


def lever_ab(args: argparse.Namespace) -> dict:
  """What each lever costs the loop, measured by alternation in one process.

  Alternates segments of 8 train steps: one with no save, and one per mode
  of `AB_MODES`, each taking one snapshot or save at the segment's third
  step; a save's segment ends by waiting for it to be durable. The
  difference from the segments without a save is the lever's whole cost to
  the loop: its blocking time, what it does to the steps after it (a pinned
  buffer cannot be donated, so the next step copies its input into new
  memory), and the CPU its background work takes from them. Medians over
  `--ab` rounds, the order of the segments rotated from round to round.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import flax_ckpt_plugin  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin.save import snapshot  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin.backends import datafile  # pylint: disable=g-import-not-at-top

  state, train_step = build(args)
  # One staging area per snapshot mode: a shared one would free one mode's
  # buffers in the other's segment.
  host_staging, staging = snapshot.HostStaging(), snapshot.HostStaging()
  root = tempfile.mkdtemp(dir=args.dir)
  # Nothing is deleted until the end: retention would free one mode's
  # files inside another mode's segment.
  mngr = flax_ckpt_plugin.CheckpointManager(os.path.join(root, "ab"),
                                            max_to_keep=None)
  direct_flag = datafile.O_DIRECT
  segs = {mode: [] for mode in ("none", *AB_MODES)}
  blocking = {mode: [] for mode in AB_MODES}
  step = 0
  modes = list(segs)
  for r in range(args.ab):
    # Rotated each round, so that no mode always follows the same one.
    for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
      held = None
      t0 = time.perf_counter()
      for i in range(8):
        state, loss = train_step(state)
        float(loss)
        step += 1
        if i != 2 or mode == "none":
          continue
        t = time.perf_counter()
        if mode == "pin":
          held = [np.asarray(a) for a in jax.tree.leaves(state)]
        elif mode == "host_copy":
          held = host_staging.copy([((k,), np.asarray(s.data)) for k, a in
                               enumerate(jax.tree.leaves(state))
                               for s in a.addressable_shards])
        elif mode == "enqueued_copy":
          held = snapshot.take_snapshot(state, process_count=1,
                                        is_primary=True, staging=staging)
        else:
          datafile.O_DIRECT = direct_flag if mode == "save_direct" else 0
          mngr.save(step, state)
        blocking[mode].append(time.perf_counter() - t)
      mngr.wait_until_finished()
      del held
      segs[mode].append(time.perf_counter() - t0)
  datafile.O_DIRECT = direct_flag
  mngr.close()
  shutil.rmtree(root, ignore_errors=True)
  base = statistics.median(segs["none"])
  return {mode: {"cost_per_save_secs": statistics.median(segs[mode]) - base,
                 "blocking_secs": statistics.median(blocking[mode])}
          for mode in AB_MODES}


def worker(args: argparse.Namespace) -> dict:
  """One system's measurements, in a fresh process."""
  state, train_step = build(args)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  nbytes = sum(a.nbytes for a in jax.tree.leaves(state))

  root = args.ckpt_root or tempfile.mkdtemp(dir=args.dir)
  out = {"system": args.worker, "state_bytes": nbytes}
  # 6, first: 1/4 of the state (at least 64 MiB), before RSS nears its peak.
  out["touch_secs_per_gb"] = _touch_secs_per_gb(max(nbytes // 4, 64 << 20))

  def run_loop(save):
    nonlocal state
    t0 = time.perf_counter()
    blocking = []
    for step in range(1, args.steps + 1):
      state, loss = train_step(state)
      float(loss)  # A loop that logs its loss waits for each step.
      b = save(step, state)
      if b is not None:
        blocking.append(b)
    return time.perf_counter() - t0, blocking

  def no_save(step, s):
    return None

  base, _ = run_loop(no_save)
  out["rss_mb_train_only"] = _rss_mb()

  open_manager, save_now, restore = scaling.system(args.worker)

  def loop_with_saves(name, save_at):
    """The loop with a new manager saving at the steps `save_at` picks."""
    directory = os.path.join(root, name)
    mngr = open_manager(directory)

    def save(step, s):
      if not save_at(step):
        return None
      t = time.perf_counter()
      save_now(mngr, step, s)
      return time.perf_counter() - t

    secs, blocking = run_loop(save)
    t = time.perf_counter()
    mngr.wait_until_finished()
    secs += time.perf_counter() - t
    mngr.close()
    shutil.rmtree(directory, ignore_errors=True)
    return secs, blocking

  # 1 + 2: each round runs the loop with a save every `every` steps (the
  # last at the last step, waited for), and the same saves in the middle of
  # each interval (steps 5, 15, 25, 35 of 40: each save's whole cost, its
  # blocking and its commit beside the steps after it, falls inside the
  # measured steps, as in a long run). Each gets a new manager, as a new
  # training run would. Every loop with saves sits between two loops without,
  # and is compared to their mean: that cancels a machine that speeds up or
  # slows down over minutes (shared VMs do, by tens of percent).
  def periodic(step):
    return step % args.every == 0

  def mid(step):
    return (step - args.every // 2) % args.every == 0

  nones, loops = [base], {"periodic": [], "mid": []}
  ratios = {name: [] for name in loops}
  out["blocking_secs"] = []
  for r in range(args.rounds):
    for name, save_at in (("periodic", periodic), ("mid", mid)):
      secs, blocking = loop_with_saves(f"{name}{r}", save_at)
      loops[name].append(secs)
      if name == "periodic":
        out["blocking_secs"] += blocking
      nones.append(run_loop(no_save)[0])
      ratios[name].append(secs / ((nones[-2] + nones[-1]) / 2) - 1)
  out["loop_secs_no_saves"] = nones
  out["loop_secs_with_saves"] = loops["periodic"]
  out["loop_secs_saves_mid_interval"] = loops["mid"]
  out["loop_overhead_rounds"] = ratios["periodic"]
  out["loop_overhead_steady_rounds"] = ratios["mid"]

  # 3: one isolated save until durable, then the raw ceiling.
  mngr = open_manager(os.path.join(root, "isolated"))
  t = time.perf_counter()
  save_now(mngr, 1, state)
  mngr.wait_until_finished()
  out["isolated_save_secs"] = time.perf_counter() - t
  raw_path = os.path.join(root, "raw.bin")
  host = [np.asarray(a) for a in jax.tree.leaves(state)]
  t = time.perf_counter()
  with open(raw_path, "wb", buffering=0) as f:
    for a in host:
      f.write(memoryview(a.reshape(-1).view(np.uint8)))
    os.fsync(f.fileno())
  out["raw_write_fsync_secs"] = time.perf_counter() - t
  del host
  t = time.perf_counter()
  os.unlink(raw_path)
  out["unlink_raw_secs"] = time.perf_counter() - t
  out["direct_write_gbps"] = machine.direct_write_gbps(
      os.path.join(root, "direct.bin"), nbytes)

  # 4: warm restore into a target sharded over 2 devices.
  target = _sharded_target(args, lambda: state)
  # The first restore, timed: right after the save, in the saving process
  # (ours takes the bytes from the snapshot it still holds, Orbax reads
  # its files). It warms the page cache, is checked bit for bit, and
  # compiles the train step for the sharded state.
  t = time.perf_counter()
  restored = restore(mngr, 1, target)
  jax.block_until_ready(restored)
  out["restore_after_save_secs"] = time.perf_counter() - t
  ok = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
      jax.tree.leaves(restored), jax.tree.leaves(state)))
  out["restore_bit_identical"] = bool(ok)
  restored, loss = train_step(restored)
  float(loss)
  # Each timed restore is followed by the train step that uses it, timed
  # too: a restore whose arrays the step cannot donate moves part of its
  # cost into that step (it copies the whole state first). The restore's
  # CPU time (all threads) and minor page faults show what bounds it.
  for key in ("warm_restore_secs", "step_after_restore_secs",
              "restore_cpu_secs", "restore_page_faults"):
    out[key] = []
  for _ in range(3):
    restored = None  # The previous state's memory is freed first.
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu, t = time.process_time(), time.perf_counter()
    restored = restore(mngr, 1, target)
    jax.block_until_ready(restored)
    out["warm_restore_secs"].append(time.perf_counter() - t)
    out["restore_cpu_secs"].append(time.process_time() - cpu)
    out["restore_page_faults"].append(
        resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    t = time.perf_counter()
    restored, loss = train_step(restored)
    float(loss)
    out["step_after_restore_secs"].append(time.perf_counter() - t)
  restored = None
  t = time.perf_counter()
  for _ in range(3):
    state, loss = train_step(state)
    float(loss)
  out["step_secs"] = (time.perf_counter() - t) / 3
  mngr.close()
  out["rss_mb_peak"] = _rss_mb()
  if args.ckpt_root:  # The fresh restores read the isolated step next.
    for name in os.listdir(root):
      if name != "isolated":
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
  else:
    shutil.rmtree(root, ignore_errors=True)
  # 6, last, so that its memory stays out of the peak RSS.
  out["restore_floor_secs"], _ = machine.fill_floor_secs(nbytes, huge=False)
  (out["restore_floor_thp_secs"],
   out["restore_floor_thp_huge_share"]) = machine.fill_floor_secs(nbytes,
                                                                  huge=True)
  out["restore_floor_parallel_secs"] = machine.parallel_fill_secs(nbytes)
  return out


def _median(runs: list[dict], key: str) -> float:
  return statistics.median(r[key] for r in runs)


def _median_of_medians(runs: list[dict], key: str) -> float:
  """The median over runs of each run's median of its list `key`."""
  return statistics.median(statistics.median(r[key]) for r in runs)


def summarize(results: dict[str, list[dict]]) -> dict:
  """Medians per system and the ratios the targets are stated in."""
  s = {}
  for name, runs in results.items():
    gb = runs[0]["state_bytes"] / 1e9
    restore = _median_of_medians(runs, "warm_restore_secs")
    s[name] = {
        "loop_overhead": _median_of_medians(runs, "loop_overhead_rounds"),
        "loop_overhead_steady": _median_of_medians(
            runs, "loop_overhead_steady_rounds"),
        "blocking_secs": _median_of_medians(runs, "blocking_secs"),
        "isolated_save_secs": _median(runs, "isolated_save_secs"),
        "isolated_save_gbps": gb / _median(runs, "isolated_save_secs"),
        "raw_write_fsync_gbps": statistics.median(
            gb / r["raw_write_fsync_secs"] for r in runs),
        "save_vs_ceiling": statistics.median(
            r["raw_write_fsync_secs"] / r["isolated_save_secs"]
            for r in runs),
        "direct_write_gbps": statistics.median(
            r.get("direct_write_gbps") or float("nan") for r in runs),
        "warm_restore_secs": restore,
        "warm_restore_gbps": gb / restore,
        "warm_restore_vs_floor": statistics.median(
            statistics.median(r["warm_restore_secs"]) / r["restore_floor_secs"]
            for r in runs),
        "warm_restore_vs_parallel_floor": statistics.median(
            statistics.median(r["warm_restore_secs"])
            / r["restore_floor_parallel_secs"] for r in runs),
        "restore_after_save_secs": _median(runs, "restore_after_save_secs"),
        "restore_after_save_vs_parallel_floor": statistics.median(
            r["restore_after_save_secs"] / r["restore_floor_parallel_secs"]
            for r in runs),
        "fresh_restore_secs": _median(runs, "fresh_restore_secs"),
        "fresh_restore_vs_parallel_floor": statistics.median(
            r["fresh_restore_secs"] / r["fresh_restore_floor_parallel_secs"]
            for r in runs),
        "fresh_restore_cold_secs": _median(runs, "fresh_restore_cold_secs"),
        "step_after_restore_secs": _median_of_medians(
            runs, "step_after_restore_secs"),
        "restore_cpu_secs": _median_of_medians(runs, "restore_cpu_secs"),
        "restore_page_faults": _median_of_medians(runs,
                                                  "restore_page_faults"),
        "step_secs": _median(runs, "step_secs"),
        "rss_mb_peak": _median(runs, "rss_mb_peak"),
        "rss_mb_above_train_loop": statistics.median(
            r["rss_mb_peak"] - r["rss_mb_train_only"] for r in runs),
        "restore_bit_identical": all(r["restore_bit_identical"]
                                     for r in runs),
    }
  # The machine's limits, over every process of both systems.
  s["machine"] = {key: statistics.median(
      r[key] for runs in results.values() for r in runs)
                  for key in ("touch_secs_per_gb", "unlink_raw_secs",
                              "restore_floor_secs", "restore_floor_thp_secs",
                              "restore_floor_parallel_secs")}
  ours, orbax = s["ours"], s["orbax"]
  s["ratios"] = {
      "loop_overhead": ours["loop_overhead"] / orbax["loop_overhead"]
                       if orbax["loop_overhead"] > 0 else float("nan"),
      "loop_overhead_steady": (
          ours["loop_overhead_steady"] / orbax["loop_overhead_steady"]
          if orbax["loop_overhead_steady"] > 0 else float("nan")),
      "blocking": ours["blocking_secs"] / orbax["blocking_secs"],
      "isolated_save": ours["isolated_save_secs"]
                       / orbax["isolated_save_secs"],
      "warm_restore": ours["warm_restore_secs"] / orbax["warm_restore_secs"],
      "restore_after_save": ours["restore_after_save_secs"]
                            / orbax["restore_after_save_secs"],
      "fresh_restore": ours["fresh_restore_secs"]
                       / orbax["fresh_restore_secs"],
      "fresh_restore_cold": ours["fresh_restore_cold_secs"]
                            / orbax["fresh_restore_cold_secs"],
      "rss_peak": ours["rss_mb_peak"] / orbax["rss_mb_peak"],
  }
  return s


def print_table(s: dict, runs: int, gb: float) -> None:
  ours, orbax, r = s["ours"], s["orbax"], s["ratios"]
  rows = [
      ("train-loop overhead (save every K)", f"{ours['loop_overhead']:+.1%}",
       f"{orbax['loop_overhead']:+.1%}", f"{r['loop_overhead']:.3f}", "<= 0.25"),
      ("  steady state (saves mid-interval)",
       f"{ours['loop_overhead_steady']:+.1%}",
       f"{orbax['loop_overhead_steady']:+.1%}",
       f"{r['loop_overhead_steady']:.3f}", "<= 0.25"),
      ("blocking per save call (s)", f"{ours['blocking_secs']:.3f}",
       f"{orbax['blocking_secs']:.3f}", f"{r['blocking']:.3f}", "<= 1"),
      ("isolated save to durable (s)", f"{ours['isolated_save_secs']:.3f}",
       f"{orbax['isolated_save_secs']:.3f}", f"{r['isolated_save']:.3f}",
       "<= 0.6"),
      ("  GB/s (raw write+fsync GB/s)",
       f"{ours['isolated_save_gbps']:.2f} ({ours['raw_write_fsync_gbps']:.2f})",
       f"{orbax['isolated_save_gbps']:.2f} ({orbax['raw_write_fsync_gbps']:.2f})",
       f"{ours['save_vs_ceiling']:.0%} of ceiling", ">= 70%"),
      ("  / the disk's direct-write rate",
       f"{ours['isolated_save_gbps'] / ours['direct_write_gbps']:.2f}"
       f" of {ours['direct_write_gbps']:.2f} GB/s",
       f"{orbax['isolated_save_gbps'] / orbax['direct_write_gbps']:.2f}"
       f" of {orbax['direct_write_gbps']:.2f} GB/s", "", "ours >= 0.8"),
      ("restore right after the save, same process (s)",
       f"{ours['restore_after_save_secs']:.3f}",
       f"{orbax['restore_after_save_secs']:.3f}",
       f"{r['restore_after_save']:.3f}", "<= 0.5"),
      ("  / all cores filling new 4 KiB pages at once",
       f"{ours['restore_after_save_vs_parallel_floor']:.2f}",
       f"{orbax['restore_after_save_vs_parallel_floor']:.2f}", "",
       "ours <= 1.25"),
      ("warm restore, sharded (s)", f"{ours['warm_restore_secs']:.3f}",
       f"{orbax['warm_restore_secs']:.3f}", f"{r['warm_restore']:.3f}",
       "<= 0.25"),
      ("  / restore floor (new 4 KiB pages filled)",
       f"{ours['warm_restore_vs_floor']:.2f}",
       f"{orbax['warm_restore_vs_floor']:.2f}", "", "ours <= 1.25"),
      ("  / all cores filling new 4 KiB pages at once",
       f"{ours['warm_restore_vs_parallel_floor']:.2f}",
       f"{orbax['warm_restore_vs_parallel_floor']:.2f}", "", ""),
      ("  its CPU time, all threads (s)",
       f"{ours['restore_cpu_secs']:.2f}", f"{orbax['restore_cpu_secs']:.2f}",
       "", ""),
      ("  its minor page faults",
       f"{ours['restore_page_faults']:.0f}",
       f"{orbax['restore_page_faults']:.0f}", "", ""),
      ("  then the first train step (s)",
       f"{ours['step_after_restore_secs']:.3f}",
       f"{orbax['step_after_restore_secs']:.3f}",
       f"(any step: {ours['step_secs']:.3f}, {orbax['step_secs']:.3f})", ""),
      ("first restore in a fresh process (s)",
       f"{ours['fresh_restore_secs']:.3f}",
       f"{orbax['fresh_restore_secs']:.3f}", f"{r['fresh_restore']:.3f}", ""),
      ("  / all cores filling new 4 KiB pages at once",
       f"{ours['fresh_restore_vs_parallel_floor']:.2f}",
       f"{orbax['fresh_restore_vs_parallel_floor']:.2f}", "", "ours <= 1.25"),
      ("  its files dropped from the page cache (s)",
       f"{ours['fresh_restore_cold_secs']:.3f}",
       f"{orbax['fresh_restore_cold_secs']:.3f}",
       f"{r['fresh_restore_cold']:.3f}", ""),
      ("peak RSS (MB)", f"{ours['rss_mb_peak']:.0f}",
       f"{orbax['rss_mb_peak']:.0f}", f"{r['rss_peak']:.3f}", "<= 1"),
      ("  RSS above the train loop (MB)",
       f"{ours['rss_mb_above_train_loop']:.0f}",
       f"{orbax['rss_mb_above_train_loop']:.0f}", "", ""),
  ]
  print(f"\nstate {gb:.3f} GB, median of {runs} run(s) per system")
  head = ("", "flax_ckpt_plugin", "Orbax", "ours/Orbax", "target")
  widths = [max(len(str(row[i])) for row in rows + [head]) for i in range(5)]
  for row in [head] + rows:
    print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
  print(f"restores bit-identical: ours {ours['restore_bit_identical']},"
        f" Orbax {orbax['restore_bit_identical']}")
  limits = s["machine"]
  print(f"machine: touching new memory takes"
        f" {limits['touch_secs_per_gb']:.2f} s per GB on one core; deleting"
        f" the {gb:.3f} GB raw file took {limits['unlink_raw_secs']:.3f} s;"
        f" filling {gb:.3f} GB of new memory takes"
        f" {limits['restore_floor_secs']:.3f} s per core with 4 KiB pages,"
        f" {limits['restore_floor_thp_secs']:.3f} s with huge pages;"
        f" all cores at once filling their shares took"
        f" {limits['restore_floor_parallel_secs']:.3f} s")


def main() -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", choices=("dense",) + shapes.SHAPES,
                      default="dense",
                      help="dense: this benchmark; the others: the scaling"
                      " benchmark on a model-like state (scaling.py)")
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--width", type=int, default=3200)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--every", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=3,
                      help="runs per system, each in a new process")
  parser.add_argument("--rounds", type=int, default=2,
                      help="loops with saves per kind in each run, each"
                      " between two loops without")
  parser.add_argument("--dir", default=None,
                      help="where checkpoints are written (default: a temp"
                      " dir)")
  parser.add_argument("--json", default=None, help="write all figures here")
  parser.add_argument("--ab", type=int, default=5, metavar="N",
                      help="also measure N rounds of the snapshot and write"
                      " levers against each other, in one process of ours;"
                      " 0 skips it")
  parser.add_argument("--worker", choices=SYSTEMS + ("ab",),
                      help=argparse.SUPPRESS)
  scaling.add_arguments(parser)
  args = parser.parse_args()
  passthrough = [a for a in sys.argv[1:]]
  if "--json" in passthrough:
    i = passthrough.index("--json")
    del passthrough[i:i + 2]
  if args.shape != "dense":
    scaling.main(args, passthrough, __file__)
    return
  if args.worker == "ab":
    print(json.dumps(lever_ab(args)))
    return
  if args.worker:
    print(json.dumps(fresh_restore(args) if args.phase else worker(args)))
    return
  results = {name: [] for name in SYSTEMS}
  for rep, name in scaling.in_turn(args.repeats):
    root = tempfile.mkdtemp(dir=args.dir)
    run = {}
    try:
      for phase in (None, "fresh_restore_cold", "fresh_restore"):
        proc = subprocess.run(
            [sys.executable, __file__, *passthrough, "--worker", name,
             "--ckpt-root", root] + (["--phase", phase] if phase else []),
            capture_output=True, text=True, check=False)
        if proc.returncode:
          sys.exit(f"{name} {phase or 'save'} run failed:\n{proc.stdout}\n"
                   f"{proc.stderr[-4000:]}")
        run.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    finally:
      shutil.rmtree(root, ignore_errors=True)
    results[name].append(run)
    print(f"run {rep + 1}/{args.repeats} {name}: " + ", ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else
        f"{k}=[{', '.join(f'{x:.3f}' for x in v)}]"
        for k, v in run.items() if isinstance(v, (float, list))),
        flush=True)
  summary = summarize(results)
  print_table(summary, args.repeats, results["ours"][0]["state_bytes"] / 1e9)
  if args.ab:
    proc = subprocess.run(
        [sys.executable, __file__, *passthrough, "--worker", "ab"],
        capture_output=True, text=True, check=False)
    if proc.returncode:
      sys.exit(f"lever A/B run failed:\n{proc.stdout}\n"
               f"{proc.stderr[-4000:]}")
    ab = json.loads(proc.stdout.strip().splitlines()[-1])
    summary["lever_ab"] = ab
    print(f"\nlevers, one process of ours, median of {args.ab} rounds of"
          " alternating 8-step segments:")
    width = max(len(d) for d in AB_MODES.values())
    print(f"{'':{width}}  blocks (s)  costs the loop per save (s)")
    for mode, desc in AB_MODES.items():
      print(f"{desc:{width}}  {ab[mode]['blocking_secs']:10.3f}"
            f"  {ab[mode]['cost_per_save_secs']:+.3f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "runs": results, "summary": summary}, f,
                indent=1)


if __name__ == "__main__":
  main()
