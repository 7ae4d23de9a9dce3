"""How saves and restores scale on model-like states, next to Orbax.

    python benchmarks/bench.py --shape many --leaves 5000 --state-mb 200
    python benchmarks/bench.py --shape transformer --saves 100
    python benchmarks/bench.py --shape large          # 6 GB of 64-128 MB leaves

`bench.py --shape dense` measures one state of 8 large leaves; real models
have thousands of leaves of every size, optimizer namedtuples, and states
from hundreds of MB to most of the host's memory (see `shapes.py`). For each
shape, each system runs `--repeats` times, alternating which goes first,
each run in two fresh processes of its own:

1. the save process: the first save in a fresh process, its blocking time
   and its time until durable. A preemptible job pays it after every
   restart, with whatever the first save sets up (threads, staging memory,
   compiled copies) on top of the save itself;
2. then `--saves` saves in all (the first included), each after one train
   step and each waited for before the next step, so each is a whole save:
   the blocking time and the time until durable of every one, and their
   medians over saves 2 and later (the steady state);
3. the process's current RSS (/proc/self/statm, not the peak) after the
   3rd save and after the last: a checkpointer that keeps something per
   save grows, and a long job pays for it (`--saves 100`);
4. the peak RSS over the saves (ru_maxrss, reset to the current RSS just
   before the first save) above the RSS before it, per byte of state: one
   staging copy of the state is the expected cost (target 1.1, with 10% of
   slack);
5. the restore process: the first restore in a fresh process, into an
   abstract target (`ShapeDtypeStruct`s on device 0) of the newest step the
   save process wrote, until the arrays are ready (the files are in the page
   cache: they were just written); then 3 more restores there (their
   median: the warm restore). The first and last restores are checked bit
   for bit against digests the save process wrote of the state it saved.

The checkpoint directory is kept between the two processes and removed
after them. Prints the medians over runs with the ratios ours / Orbax, and
writes all figures to `--json`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import machine
import shapes

SYSTEMS = ("ours", "orbax")
DIGESTS = "digests.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The scaling benchmark's options (the shapes' included)."""
  group = shapes.add_arguments(parser)
  group.add_argument("--saves", type=int, default=25,
                     help="saves per run, each after a train step and"
                     " waited for (at least 3)")
  # bench.py's dense state adds the fresh restores of its isolated step.
  parser.add_argument("--phase", choices=("save", "restore", "fresh_restore",
                                          "fresh_restore_cold"),
                      help=argparse.SUPPRESS)
  parser.add_argument("--ckpt-root", help=argparse.SUPPRESS)


def system(name: str, max_to_keep: int | None = 2
           ) -> tuple[Callable, Callable, Callable]:
  """The system's (open_manager, save, restore), as in bench.py."""
  if name == "ours":
    import flax_ckpt_plugin  # pylint: disable=g-import-not-at-top

    def open_manager(directory):
      return flax_ckpt_plugin.CheckpointManager(directory,
                                                max_to_keep=max_to_keep)

    def save(mngr, step, state):
      mngr.save(step, state)

    def restore(mngr, step, target):
      return mngr.restore(target, step)
  else:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    def open_manager(directory):
      return ocp.CheckpointManager(
          directory, options=ocp.CheckpointManagerOptions(
              max_to_keep=max_to_keep, enable_async_checkpointing=True))

    def save(mngr, step, state):
      mngr.save(step, args=ocp.args.StandardSave(state), force=True)

    def restore(mngr, step, target):
      return mngr.restore(step, args=ocp.args.StandardRestore(target))
  return open_manager, save, restore


def _digests(tree: Any) -> list[str]:
  """Dtype, shape and SHA-1 of the bytes of every leaf, in leaf order."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  out = []
  for leaf in jax.tree.leaves(tree):
    a = np.ascontiguousarray(np.asarray(leaf))
    digest = hashlib.sha1(a.reshape(-1).view(np.uint8)).hexdigest()
    out.append(f"{a.dtype}{list(a.shape)}:{digest}")
  return out


def _save_worker(args: argparse.Namespace) -> dict:
  """Measurements 1 to 4, in a fresh process; writes the digests."""
  open_manager, save, _ = system(args.worker)
  import jax  # pylint: disable=g-import-not-at-top
  state = shapes.build(args)
  train_step = shapes.train_step()
  leaves = jax.tree.leaves(state)
  out = {"system": args.worker, "state_bytes": sum(a.nbytes for a in leaves),
         "leaves": len(leaves)}
  mngr = open_manager(os.path.join(args.ckpt_root, "ckpt"))
  out["rss_bytes_before_first_save"] = machine.rss_bytes()
  out["peak_rss_reset"] = machine.reset_peak_rss()
  out["save_blocking_secs"], out["save_durable_secs"] = [], []
  for step in range(1, args.saves + 1):
    if step > 1:
      state, loss = train_step(state)
      float(loss)
    t = time.perf_counter()
    save(mngr, step, state)
    out["save_blocking_secs"].append(time.perf_counter() - t)
    mngr.wait_until_finished()
    out["save_durable_secs"].append(time.perf_counter() - t)
    if step == 3:
      out["rss_bytes_after_3rd_save"] = machine.rss_bytes()
  out["rss_bytes_after_last_save"] = machine.rss_bytes()
  out["peak_rss_bytes"] = machine.peak_rss_bytes()
  mngr.close()
  with open(os.path.join(args.ckpt_root, DIGESTS), "w") as f:
    json.dump({"step": args.saves, "digests": _digests(state)}, f)
  return out


def _restore_worker(args: argparse.Namespace) -> dict:
  """Measurement 5, in a fresh process of its own."""
  open_manager, _, restore = system(args.worker)
  import jax  # pylint: disable=g-import-not-at-top
  with open(os.path.join(args.ckpt_root, DIGESTS)) as f:
    saved = json.load(f)
  target = shapes.abstract_target(args)
  out = {}
  t = time.perf_counter()
  mngr = open_manager(os.path.join(args.ckpt_root, "ckpt"))
  out["open_manager_secs"] = time.perf_counter() - t
  t = time.perf_counter()
  restored = restore(mngr, saved["step"], target)
  jax.block_until_ready(restored)
  out["fresh_restore_secs"] = time.perf_counter() - t
  identical = _digests(restored) == saved["digests"]
  out["warm_restore_secs"] = []
  for _ in range(3):
    restored = None  # The previous state's memory is freed first.
    t = time.perf_counter()
    restored = restore(mngr, saved["step"], target)
    jax.block_until_ready(restored)
    out["warm_restore_secs"].append(time.perf_counter() - t)
  out["restore_bit_identical"] = (
      identical and _digests(restored) == saved["digests"])
  mngr.close()
  return out


def worker(args: argparse.Namespace) -> dict:
  if args.phase == "save":
    return _save_worker(args)
  return _restore_worker(args)


def _run_worker(script: str, passthrough: list[str], name: str, phase: str,
                root: str) -> dict:
  proc = subprocess.run(
      [sys.executable, script, *passthrough, "--worker", name, "--phase",
       phase, "--ckpt-root", root],
      capture_output=True, text=True, check=False)
  if proc.returncode:
    raise RuntimeError(f"{name} {phase} run failed:\n{proc.stdout}\n"
                       f"{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(values) -> float:
  return statistics.median(values) if values else float("nan")


def summarize(results: dict[str, list[dict]]) -> dict:
  """Medians over runs per system, and the ratios ours / Orbax."""
  s = {}
  for name, runs in results.items():
    s[name] = {
        "first_save_blocking_secs": _median(
            [r["save_blocking_secs"][0] for r in runs]),
        "first_save_durable_secs": _median(
            [r["save_durable_secs"][0] for r in runs]),
        "later_save_blocking_secs": _median(
            [_median(r["save_blocking_secs"][1:]) for r in runs]),
        "later_save_durable_secs": _median(
            [_median(r["save_durable_secs"][1:]) for r in runs]),
        "fresh_restore_secs": _median([r["fresh_restore_secs"]
                                       for r in runs]),
        "warm_restore_secs": _median([_median(r["warm_restore_secs"])
                                      for r in runs]),
        "peak_rss_above_loop_per_state_byte": _median([
            (r["peak_rss_bytes"] - r["rss_bytes_before_first_save"])
            / r["state_bytes"] for r in runs]),
        "rss_growth": _median([
            (r["rss_bytes_after_last_save"] - r["rss_bytes_after_3rd_save"])
            / r["rss_bytes_after_3rd_save"] for r in runs]),
        "restore_bit_identical": all(r["restore_bit_identical"]
                                     for r in runs),
    }
  ours, orbax = s["ours"], s["orbax"]
  s["ratios"] = {
      key: ours[key] / orbax[key] if orbax[key] > 0 else float("nan")
      for key in ours if key != "restore_bit_identical"}
  return s


ROWS = (  # (label, key, format, target)
    ("first save: blocking (s)", "first_save_blocking_secs", ".3f", "<= 1"),
    ("first save: until durable (s)", "first_save_durable_secs", ".3f",
     "<= 1"),
    ("later saves: blocking, median (s)", "later_save_blocking_secs", ".3f",
     "<= 0.5"),
    ("later saves: until durable, median (s)", "later_save_durable_secs",
     ".3f", "<= 0.6"),
    ("restore in a fresh process (s)", "fresh_restore_secs", ".3f", "<= 0.5"),
    ("warm restore, median of 3 (s)", "warm_restore_secs", ".3f", "<= 0.5"),
    ("peak RSS above the loop / state bytes",
     "peak_rss_above_loop_per_state_byte", ".2f", "ours <= 1.1"),
    ("RSS growth, 3rd -> last save", "rss_growth", "+.1%", "ours <= 2%"),
)


def print_table(s: dict, args: argparse.Namespace, run: dict) -> None:
  ours, orbax, r = s["ours"], s["orbax"], s["ratios"]
  rows = [(label, format(ours[key], fmt), format(orbax[key], fmt),
           "n/a" if math.isnan(r[key]) else f"{r[key]:.3f}", target)
          for label, key, fmt, target in ROWS]
  print(f"\nshape {args.shape}: {run['leaves']} leaves,"
        f" {run['state_bytes'] / 1e6:.1f} MB; {args.saves} saves per run;"
        f" median of {args.repeats} run(s) per system")
  head = ("", "flax_ckpt_plugin", "Orbax", "ours/Orbax", "target")
  widths = [max(len(row[i]) for row in rows + [head]) for i in range(5)]
  for row in [head] + rows:
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
  print(f"restores bit-identical: ours {ours['restore_bit_identical']},"
        f" Orbax {orbax['restore_bit_identical']}")


def _brief(run: dict) -> str:
  """One run's figures on one line."""
  return (f"first save {run['save_blocking_secs'][0]:.3f} s blocking,"
          f" {run['save_durable_secs'][0]:.3f} s durable; later"
          f" {_median(run['save_blocking_secs'][1:]):.3f} s,"
          f" {_median(run['save_durable_secs'][1:]):.3f} s; fresh restore"
          f" {run['fresh_restore_secs']:.3f} s, warm"
          f" {_median(run['warm_restore_secs']):.3f} s; peak RSS"
          f" {run['peak_rss_bytes'] / 1e6:.0f} MB")


def in_turn(repeats: int) -> Any:
  """(run, system) for `repeats` runs of each system, alternating which
  goes first."""
  for rep in range(repeats):
    for name in SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]:
      yield rep, name


def main(args: argparse.Namespace, passthrough: list[str],
         script: str) -> None:
  """A worker's phase, or the whole comparison (see the module docstring)."""
  if args.saves < 3:
    sys.exit("--saves must be at least 3 (RSS growth starts at the 3rd)")
  if args.shape == "many" and args.leaves < 100:
    sys.exit("--leaves must be at least 100")
  if args.worker:
    print(json.dumps(worker(args)))
    return
  results = {name: [] for name in SYSTEMS}
  for rep, name in in_turn(args.repeats):
    root = tempfile.mkdtemp(dir=args.dir)
    try:
      run = _run_worker(script, passthrough, name, "save", root)
      run.update(_run_worker(script, passthrough, name, "restore", root))
    except RuntimeError as e:
      sys.exit(str(e))
    finally:
      shutil.rmtree(root, ignore_errors=True)
    results[name].append(run)
    print(f"run {rep + 1}/{args.repeats} {name}: {_brief(run)}", flush=True)
  summary = summarize(results)
  print_table(summary, args, results["ours"][0])
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "runs": results, "summary": summary}, f,
                indent=1)
