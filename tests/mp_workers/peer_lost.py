"""A train loop whose process VICTIM kills itself with SIGKILL mid-run.

Usage: peer_lost.py DIR VICTIM KILL_STEP HEARTBEAT_SECS

Every process runs a callback that saves every 3 steps (each save meets the
others at barriers in its commit), with JAX's recoverability on, so the
survivors live on after the kill. The victim writes the wall-clock time to
DIR/killed_at just before it kills itself. Each survivor reports what its
loop raised, at which step, and how long after the kill; then it exits
with `PREEMPTED_EXIT_CODE`, as the documented loop does (the library's exit
hook ends the process before JAX's own shutdown, which aborts when a peer
is gone, and process 0 last).
"""

import os
import pathlib
import signal
import sys
import time

import _setup

DIR = pathlib.Path(sys.argv[1])
VICTIM, KILL_STEP, HEARTBEAT = (int(a) for a in sys.argv[2:5])
_setup.init(recoverable=True, heartbeat_timeout_seconds=HEARTBEAT)

import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

from flax_ckpt_plugin import CheckpointCallback  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax_ckpt_plugin import PeerLostError  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax_ckpt_plugin import PREEMPTED_EXIT_CODE  # pylint: disable=g-import-not-at-top,wrong-import-position

cb = CheckpointCallback(DIR / "ckpt", every_steps=3)
state = {"w": jnp.arange(64.0) + _setup.PROCESS_ID}
result = {"raised": None}
step = 0
try:
  for step in range(1, 10_000):
    time.sleep(0.05)  # The step's own work (no collective: see the test).
    state = {"w": state["w"] + 1}
    if _setup.PROCESS_ID == VICTIM and step == KILL_STEP:
      (DIR / "killed_at").write_text(repr(time.time()))
      os.kill(os.getpid(), signal.SIGKILL)
    cb(step, state)
  cb.close()
except PeerLostError as e:
  result = {"raised": "PeerLostError", "lost": {str(k): v for k, v in
                                                 e.lost.items()},
            "message": str(e)}
except Exception as e:  # pylint: disable=broad-except
  result = {"raised": type(e).__name__, "message": str(e)}
result["step"] = step
result["secs_after_kill"] = time.time() - float(
    (DIR / "killed_at").read_text())
_setup.emit(result)
sys.exit(PREEMPTED_EXIT_CODE if result["raised"] == "PeerLostError" else 1)
