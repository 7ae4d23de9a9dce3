"""The save call alone: what a train loop waits for at each save, and the
call's own CPU time, in one fresh process of this project.

    python benchmarks/save_call.py                        # bench.py's state
    python benchmarks/save_call.py --shape many --leaves 1500 --saves 16
    python benchmarks/save_call.py --layers 2 --width 128 --managers 1 \\
        --saves 2 --json /tmp/save_call.json              # seconds, for CI

`dense` (default) is `bench.py`'s state and train step: `--managers`
managers in turn (a new one as a new training run would open), each saving
every `--every` steps, `--saves` times, in a loop that waits for each
step; the first manager's first saves run while the copy programs compile
in the background. `many` is `shapes.py`'s state of `--leaves` leaves,
saved after each step, each save waited for before the next step (the
loop pays the call alone). Printed per save: the call's wall time and its
thread's CPU time (the rest is waiting for a core or for the interpreter's
lock), then their medians. Ratios against Orbax are `bench.py`'s; this one
takes the call apart across commits (run it from each one's tree).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # pylint: disable=g-import-not-at-top,wrong-import-position
import shapes  # pylint: disable=g-import-not-at-top,wrong-import-position


def _timed_save(manager, step, state) -> tuple[float, float]:
  cpu, wall = time.thread_time(), time.perf_counter()
  manager.save(step, state)
  return time.perf_counter() - wall, time.thread_time() - cpu


def run(args: argparse.Namespace) -> dict:
  import flax_ckpt_plugin  # pylint: disable=g-import-not-at-top
  if args.shape == "dense":
    state, train_step = bench.build(args)
  else:
    state, train_step = shapes.build(args), shapes.train_step()
  root = tempfile.mkdtemp(dir=args.dir)
  calls = []  # (manager, save, wall secs, CPU secs)
  try:
    for m in range(args.managers):
      directory = os.path.join(root, f"run{m}")
      manager = flax_ckpt_plugin.CheckpointManager(directory, max_to_keep=2)
      every = args.every if args.shape == "dense" else 1
      for step in range(1, every * args.saves + 1):
        state, loss = train_step(state)
        float(loss)  # A loop that logs its loss waits for each step.
        if args.shape != "dense":
          manager.wait_until_finished()
        if step % every == 0:
          calls.append((m, step // every, *_timed_save(manager, step,
                                                         state)))
      manager.wait_until_finished()
      manager.close()
      shutil.rmtree(directory, ignore_errors=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return {"shape": args.shape, "calls": calls,
          "median_wall_secs": statistics.median(c[2] for c in calls),
          "median_cpu_secs": statistics.median(c[3] for c in calls)}


def main() -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", choices=("dense", "many"), default="dense")
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--width", type=int, default=3200)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--every", type=int, default=10)
  parser.add_argument("--managers", type=int, default=4)
  parser.add_argument("--saves", type=int, default=4,
                      help="saves per manager")
  parser.add_argument("--dir", default=None)
  parser.add_argument("--json", default=None, help="write all figures here")
  shapes.add_arguments(parser)
  args = parser.parse_args()
  if args.shape == "many":
    args.managers = 1
  result = run(args)
  for m, k, wall, cpu in result["calls"]:
    print(f"manager {m} save {k}: call {wall * 1e3:.1f} ms,"
          f" its CPU {cpu * 1e3:.1f} ms")
  print(f"median of {len(result['calls'])}: call"
        f" {result['median_wall_secs'] * 1e3:.1f} ms, its CPU"
        f" {result['median_cpu_secs'] * 1e3:.1f} ms")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f)


if __name__ == "__main__":
  main()
