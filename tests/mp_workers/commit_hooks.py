"""Commit hooks with 2 processes: they run on the primary only, and a failing
hook is raised by every process.

    commit_hooks.py DIR

Both processes register a hook that records its calls. Step 1 saves cleanly;
the hook raises at step 2 (on the primary, the only process that runs it), so
every process must raise `CommitHookError` at its next call, together, and
the step stays finalized.
"""

import os
import sys

import _topology as topo

topo.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import flax_ckpt_plugin
from flax_ckpt_plugin import Processes

MESH = (2, 2)


def main(directory: str) -> dict:
  mesh = topo.make_mesh(MESH)
  state = topo.init_state(mesh)
  calls = []

  def hook(stats):
    calls.append({"step": stats.step, "path": os.fspath(stats.path),
                  "marker": (stats.path / "_COMMITTED").exists(),
                  "total_bytes": stats.total_bytes})
    if stats.step == 2:
      raise RuntimeError("evaluation launcher is down")

  mgr = flax_ckpt_plugin.CheckpointManager(
      directory, processes=Processes(barrier_timeout_secs=60), hooks=[hook])
  mgr.save(1, state)
  mgr.wait_until_finished()
  mgr.save(2, state)
  error = None
  try:
    mgr.wait_until_finished()
  except flax_ckpt_plugin.CommitHookError as e:
    error = str(e)
  result = {"is_primary": mgr.is_primary, "calls": list(calls), "error": error,
            "all_steps": mgr.all_steps(),
            "state_bytes": sum(topo.array_bytes_by_leaf(state).values())}
  mgr.save(3, state)  # The error was raised once; saving goes on.
  mgr.close()
  result["all_steps_after"] = mgr.all_steps()
  result["calls_after"] = [c["step"] for c in calls]
  return result


if __name__ == "__main__":
  topo.emit(main(sys.argv[1]))
