"""`AutoInterval` in a real loop: what it measures and what it chooses.

    python benchmarks/auto_interval.py                     # bench.py's state
    python benchmarks/auto_interval.py --mtbf 600 --steps 400
    python benchmarks/auto_interval.py --layers 2 --width 128 --steps 60 \\
        --mtbf 5 --min-every 4 --json /tmp/auto.json       # tiny, for CI

`bench.py`'s state and donating train step, on this machine's CPU, in a
loop that waits for each step (as a loop that logs its loss does), with a
`CheckpointCallback(every_steps=AutoInterval(mtbf_secs=...))` given
`--mtbf`. Printed per save, from its metrics: the measured cost C (the
loop's wait in the call that saved, plus the slowdown of the steps that
ran during the commit), the step time, sqrt(2 C M) and the interval
chosen; then each save's own blocking and background cost, and the steps
at which it saved.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # pylint: disable=g-import-not-at-top,wrong-import-position


class _Metrics:
  def __init__(self):
    self.rows: dict[int, dict[str, float]] = {}

  def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
    self.rows[step] = dict(scalars)


def run(args: argparse.Namespace) -> dict:
  import flax_ckpt_plugin  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin import AutoInterval  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  state, train_step = bench.build(args)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  root = tempfile.mkdtemp(dir=args.dir)
  metrics = _Metrics()
  saved = []
  try:
    cb = flax_ckpt_plugin.CheckpointCallback(
        os.path.join(root, "run"), max_to_keep=2, metric_writer=metrics,
        every_steps=AutoInterval(mtbf_secs=args.mtbf,
                                 min_every_steps=args.min_every))
    state = cb.restore_or_initialize(state)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
      state, loss = train_step(state)
      float(loss)  # A loop that logs its loss waits for each step.
      if cb(step, state):
        saved.append(step)
    secs = time.perf_counter() - t0
    cb.close()
    costs = cb.triggers.schedule.costs
    step_secs = costs.step_secs()
    own = [{"blocking_secs": s.blocking_secs,
            "background_secs": s.background_secs(step_secs),
            "steps_during_commit": s.committing_steps}
           for s in costs.saves]
  finally:
    shutil.rmtree(root, ignore_errors=True)
  keys = ("auto_every_steps", "auto_next_every_steps", "auto_cost_secs",
          "auto_blocking_secs", "auto_background_secs", "auto_step_secs",
          "auto_young_daly_secs", "auto_saves_measured", "auto_bound")
  return {"state_bytes": nbytes, "mtbf_secs": args.mtbf, "saved": saved,
          "loop_secs": secs,
          "saves": [{"step": step, **{k: metrics.rows[step][
              f"checkpoint/{k}"] for k in keys}} for step in saved],
          "last_saves_measured": own, "step_secs": step_secs}


def main() -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--width", type=int, default=3200)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--mtbf", type=float, default=300.0,
                      help="the mean time between failures given, seconds")
  parser.add_argument("--min-every", type=int, default=10)
  parser.add_argument("--dir", default=None)
  parser.add_argument("--json", default=None, help="write all figures here")
  args = parser.parse_args()
  result = run(args)
  print(f"state {result['state_bytes'] / 1e6:.0f} MB, mtbf"
        f" {args.mtbf:g}s, {args.steps} steps in {result['loop_secs']:.1f}s")
  for s in result["saves"]:
    print(f"save at step {s['step']}: next in {s['auto_every_steps']:.0f}"
          f" steps; decided {s['auto_next_every_steps']:.0f} steps from C ="
          f" {s['auto_cost_secs']:.3f}s ({s['auto_blocking_secs']:.3f}s"
          f" blocking + {s['auto_background_secs']:.3f}s background, mean of"
          f" {s['auto_saves_measured']:.0f}), step"
          f" {s['auto_step_secs']:.4f}s, sqrt(2 C M) ="
          f" {s['auto_young_daly_secs']:.2f}s")
  for i, s in enumerate(result["last_saves_measured"]):
    print(f"measured save {i}: {s['blocking_secs']:.3f}s blocking,"
          f" {s['background_secs']:.3f}s background over"
          f" {s['steps_during_commit']} steps")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f)


if __name__ == "__main__":
  main()
