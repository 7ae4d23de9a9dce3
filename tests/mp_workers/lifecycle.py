"""Two bugs of the old naming and voting, with real processes.

    lifecycle.py one_sided DIR   saves DIR/run twice, each time with a new
                                 manager whose commit hook (on process 0
                                 alone) opens a read-only manager there
    lifecycle.py restore_error DIR
                                 both restore DIR/run; process 1's reads fail
                                 with a permission error (injected: as root, a
                                 real EACCES cannot be had)
    lifecycle.py every_secs_calls DIR
                                 200 steps with every_secs=50 (a fake clock,
                                 one second per step), counting the blocking
                                 reads of the coordination service

2 processes x 2 devices. Prints what each process saw and how long its
restore took to fail, against the barrier timeout.
"""

import errno
import os
import sys
import time

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax

import _train
import flax_ckpt_plugin
from flax_ckpt_plugin.restore import data_files
from flax_ckpt_plugin import Processes
from flax_ckpt_plugin.loop import triggers

BARRIER_TIMEOUT_SECS = 30


def one_sided(directory: str) -> dict:
  run = os.path.join(directory, "run")
  state = _train.init_state()
  seen = []

  def evaluate(stats):
    # A commit hook runs on the primary host alone; a read-only manager of
    # the same directory, as an evaluation there would open.
    with flax_ckpt_plugin.CheckpointManager(run, read_only=True) as reader_:
      seen.append(reader_.latest_step())

  for step in (1, 2):  # A manager opened twice, as a restarted loop would.
    with flax_ckpt_plugin.CheckpointManager(
        run,
        processes=Processes(barrier_timeout_secs=BARRIER_TIMEOUT_SECS),
        hooks=[evaluate]) as mgr:
      mgr.save(step, state)
      mgr.wait_until_finished()
      steps = mgr.all_steps()
  return {"all_steps": steps, "hook_saw": seen}


def restore_error(directory: str) -> dict:
  if jax.process_index() == 1:
    def denied(self, name, offset, out):
      raise PermissionError(errno.EACCES, "Permission denied (injected)",
                            name)
    data_files.ByteReader.read_into = denied
  cb = flax_ckpt_plugin.CheckpointCallback(
      os.path.join(directory, "run"),
      processes=Processes(barrier_timeout_secs=BARRIER_TIMEOUT_SECS))
  t0 = time.monotonic()
  error = None
  try:
    cb.restore_or_initialize(_train.abstract_state())
  except Exception as e:  # pylint: disable=broad-except
    error = f"{type(e).__name__}: {e}"
  secs = time.monotonic() - t0
  cb.close()
  return {"error": error, "secs": secs,
          "barrier_timeout_secs": BARRIER_TIMEOUT_SECS,
          "steps_left": sorted(os.listdir(os.path.join(directory, "run")))}


class _CountingClient:
  """The coordination-service client, counting the blocking reads."""

  def __init__(self, client):
    self._client = client
    self.blocking_gets = 0

  def __getattr__(self, name):
    return getattr(self._client, name)

  def blocking_key_value_get(self, *args, **kwargs):
    self.blocking_gets += 1
    return self._client.blocking_key_value_get(*args, **kwargs)


def every_secs_calls(directory: str) -> dict:
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  counting = _CountingClient(distributed.global_state.client)
  distributed.global_state.client = counting
  now = [0.0]
  triggers.monotonic = lambda: now[0]  # This process's own clock.
  cb = flax_ckpt_plugin.CheckpointCallback(
      os.path.join(directory, "secs"), every_secs=50, max_to_keep=None,
      processes=Processes(barrier_timeout_secs=BARRIER_TIMEOUT_SECS))
  state = {"w": jax.numpy.arange(4.0)}
  saved = []
  before = counting.blocking_gets
  for step in range(1, 201):
    now[0] = float(step)  # One second per step, on every process.
    if cb(step, state):
      saved.append(step)
  calls = counting.blocking_gets - before
  cb.close()
  return {"saved": saved, "blocking_gets": calls}


if __name__ == "__main__":
  mode, path = sys.argv[1], sys.argv[2]
  _setup.emit({"one_sided": one_sided, "restore_error": restore_error,
               "every_secs_calls": every_secs_calls}[mode](path))
