"""Process 1 is SIGKILLed while writing a step; then a fresh pair restarts.

    kill_during_save.py crash DIR     save steps 2 and 4; die in step 4
    kill_during_save.py restart DIR   open DIR again, restore the newest step

2 processes x 2 devices on a (2, 2) mesh; PRIMARY_HOST in the environment
picks the primary host (0: the survivor; 1: the process that dies).

Injected fault (crash): with KILL_AT_STEP=S in its environment, this process
wraps `writer.write_process_files` so that the background write of step S
sends SIGKILL to its own process: a real SIGKILL, at a moment chosen by the
test (a machine lost mid-write cannot be produced on demand). The survivor
reports how its next call into the library ended and how long it took; then
it leaves with `os._exit(0)`, since the dead peer makes jax.distributed's
shutdown barrier fail at interpreter exit.
"""

import os
import signal
import sys
import time

import _topology as topo

topo.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax

import flax_ckpt_plugin
from flax_ckpt_plugin.save import writer
from flax_ckpt_plugin import Processes

PRIMARY_HOST = int(os.environ.get("PRIMARY_HOST", "0"))
KILL_AT_STEP = int(os.environ.get("KILL_AT_STEP", "-1"))
BARRIER_TIMEOUT_SECS = 5.0
NUM_STEPS, EVERY = 4, 2
MESH = (2, 2)


def _inject_kill() -> None:
  real = writer.write_process_files

  def dying(step_dir, leaves, process_index, **kwargs):
    # `step_dir` is "<step>.partial" (rename mode).
    if step_dir.name.split(".")[0] == str(KILL_AT_STEP):
      # Die where a real write would be: after this process's snapshot of
      # the step is on the host. (The snapshot's copy runs after the train
      # step, whose collectives need both processes; dying before it ran
      # would hang the survivor in that step, not in the save.)
      jax.block_until_ready(
          [s.data for leaf in leaves for s in leaf.shards])
      print(f"process {process_index}: SIGKILL while writing {step_dir}",
            flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    return real(step_dir, leaves, process_index, **kwargs)

  writer.write_process_files = dying


def _manager(directory: str) -> flax_ckpt_plugin.CheckpointManager:
  return flax_ckpt_plugin.CheckpointManager(
      directory, max_to_keep=None,
      processes=Processes(primary_host=PRIMARY_HOST,
                          barrier_timeout_secs=BARRIER_TIMEOUT_SECS))


def crash(directory: str) -> None:
  if KILL_AT_STEP >= 0:
    _inject_kill()
  mesh = topo.make_mesh(MESH)
  state = topo.init_state(mesh)
  train_step = topo.make_train_step(mesh)
  mgr = _manager(directory)
  saved = {}
  for step in range(1, NUM_STEPS + 1):
    state = train_step(state)
    if step % EVERY == 0:
      mgr.save(step, state)
      if step < NUM_STEPS:
        # A collective: only while both processes live.
        saved[step] = topo.leaf_digests(state)
  # The save of the last step started; process 1 dies in its write.
  t0 = time.monotonic()
  error = None
  try:
    mgr.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    error = {"type": type(e).__name__,
             "is_timeout": isinstance(e, TimeoutError),
             "message": str(e)}
  topo.emit_and_exit({
      "manager_name": mgr.name,
      "barrier_timeout_secs": BARRIER_TIMEOUT_SECS,
      "error": error,
      "error_secs": time.monotonic() - t0,
      "all_steps": mgr.all_steps(),
      "saved": saved,
  })


def restart(directory: str) -> dict:
  mgr = _manager(directory)
  # Every process passed the open barrier, so the primary's clean-up is done.
  leftovers = sorted(set(os.listdir(directory)) - {"_WRITER"})
  mesh = topo.make_mesh(MESH)
  restored = mgr.restore(topo.abstract_state(mesh, topo.SPECS))
  result = {
      "latest_step": mgr.latest_step(),
      "all_steps": mgr.all_steps(),
      "entries_after_open": leftovers,
      "restored_step": mgr.last_restore_stats.step,
      "restored": topo.leaf_digests(restored),
  }
  mgr.close()
  return result


if __name__ == "__main__":
  if sys.argv[1] == "crash":
    crash(sys.argv[2])
  else:
    topo.emit(restart(sys.argv[2]))
