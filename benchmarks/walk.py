"""The modules one save and one restore pass through, in order, as run.

    python benchmarks/walk.py            # both walks, one process, CPU
    python benchmarks/walk.py --json /tmp/walk.json

A save: `CheckpointCallback.__call__` at a save step, to the step's bytes
durable and the step finalized (the loop's thread, then the commit
thread). A restore: `restore_or_initialize` in a new callback, to the
`TrainState` placed. Each line is a module of the package that the walk
enters from another one (a call, not a return), in the order of its first
entry; the count says by how many doors it is entered: distinct calls
(caller's function, callee's function) from another module, so that a
loop over leaves counts once. A module entered by many doors is a concept
cut in two, or a helper that climbs back to its caller's floor.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import threading

PACKAGE = "flax_ckpt_plugin"


class Walk:
  """Records the package's module entries of every thread while on."""

  def __init__(self):
    self.entries: list[str] = []
    self._doors: set[tuple[str, str, str]] = set()
    self._lock = threading.Lock()
    self._root = None

  def _module(self, frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    if name == PACKAGE or name.startswith(PACKAGE + "."):
      return name[len(PACKAGE) + 1:] or "__init__"
    return None

  def _profile(self, frame, event, arg):
    del arg
    if event != "call":
      return
    here = self._module(frame)
    if here is None:
      return
    caller = frame.f_back
    while caller is not None and self._module(caller) is None:
      caller = caller.f_back  # Through jax, numpy, threading.
    if caller is None or self._module(caller) != here:
      door = (here, frame.f_code.co_qualname,
              caller.f_code.co_qualname if caller is not None else "")
      with self._lock:
        if door not in self._doors:
          self._doors.add(door)
          self.entries.append(here)

  def __enter__(self):
    threading.setprofile(self._profile)
    sys.setprofile(self._profile)
    return self

  def __exit__(self, *exc):
    sys.setprofile(None)
    threading.setprofile(None)


def report(name: str, entries: list[str]) -> dict:
  counts = collections.Counter(entries)
  print(f"{name}: {len(entries)} doors into {len(counts)} modules; most"
        f" doors into one: {counts.most_common(1)[0][1] if counts else 0}")
  order = list(dict.fromkeys(entries))
  for module in order:
    print(f"  {counts[module]:4d}  {module}")
  return {"order": order, "counts": dict(counts)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="write the walks here too")
  args = parser.parse_args()
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin import CheckpointCallback  # pylint: disable=g-import-not-at-top

  model = nn.Dense(8)
  state = train_state.TrainState.create(
      apply_fn=model.apply,
      params=model.init(jax.random.key(0), jnp.ones((1, 16))),
      tx=optax.adam(1e-3))
  workdir = tempfile.mkdtemp(prefix="walk_")
  out = {}
  cb = CheckpointCallback(os.path.join(workdir, "ckpt"), every_steps=1)
  cb(1, state)  # The first save: what compiles and warms up, not walked.
  cb.wait_until_finished()
  with Walk() as walk:
    cb(2, state)
    cb.wait_until_finished()
  out["save"] = report("save (CheckpointCallback.__call__, step 2)",
                       walk.entries)
  cb.close()
  cb = CheckpointCallback(os.path.join(workdir, "ckpt"), every_steps=1)
  with Walk() as walk:
    restored = cb.restore_or_initialize(state)
  assert int(restored.step) == 0 and type(restored) is type(state)
  out["restore"] = report("restore (restore_or_initialize)", walk.entries)
  cb.close()
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
