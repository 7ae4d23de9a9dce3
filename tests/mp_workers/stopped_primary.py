"""Process 1 saves while process 0, the coordination service's host, is gone.

    stopped_primary.py DIR

Both processes save step 1. Then process 0 prints `primary idle` and sleeps;
the test stops it (SIGSTOP: hung) or kills it (SIGKILL: dead), then creates
`DIR/go`. Process 1 waits for that file, saves step 2, and prints how the
save ended and after how many seconds. It leaves with `os._exit`, since
`jax.distributed`'s shutdown cannot meet a stopped or dead process 0: with
status `TIMEOUT_EXIT` (3) after a `TimeoutError`, `OTHER_ERROR_EXIT` (4)
after another error, 0 if the save succeeded.
"""

import os
import sys
import time

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np

import flax_ckpt_plugin
from flax_ckpt_plugin import Processes

BARRIER_TIMEOUT_SECS = 3.0
TIMEOUT_EXIT, OTHER_ERROR_EXIT = 3, 4


def _wait_for(path: str, secs: float) -> None:
  deadline = time.monotonic() + secs
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      raise RuntimeError(f"the test never created {path}")
    time.sleep(0.01)


def main(directory: str) -> None:
  mgr = flax_ckpt_plugin.CheckpointManager(
      os.path.join(directory, "run"), max_to_keep=None,
      processes=Processes(barrier_timeout_secs=BARRIER_TIMEOUT_SECS))
  state = {"w": np.arange(8, dtype=np.float32) + _setup.PROCESS_ID}
  mgr.save(1, state)
  mgr.wait_until_finished()
  if _setup.PROCESS_ID == 0:
    print("primary idle", flush=True)
    while True:  # Until the test stops or kills this process.
      time.sleep(60)
  _wait_for(os.path.join(directory, "go"), 60)
  t0 = time.monotonic()
  error = None
  try:
    mgr.save(2, state)
    mgr.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    error = e
  secs = time.monotonic() - t0
  print(f"process 1: {type(error).__name__}: {error}", file=sys.stderr)
  _setup.emit({
      "barrier_timeout_secs": BARRIER_TIMEOUT_SECS, "secs": secs,
      "error": None if error is None else {
          "type": type(error).__name__, "message": str(error)}})
  os._exit(  # pylint: disable=protected-access
      0 if error is None
      else TIMEOUT_EXIT if isinstance(error, TimeoutError)
      else OTHER_ERROR_EXIT)


if __name__ == "__main__":
  main(sys.argv[1])
