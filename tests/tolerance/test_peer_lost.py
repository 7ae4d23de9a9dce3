"""A lost process is noticed at once by the survivors (`liveness`).

Real JAX processes with recoverability on (the coordination service then
keeps the survivors alive); one is killed with a real SIGKILL in the middle
of its loop. The loop's step has no cross-process collective: on CPU a
collective with a dead peer fails by itself (gloo), which would hide
whether the watcher noticed. Saves every 3 steps meet at barriers in their
commits, so a survivor is often waiting for the dead process in one when
it dies.
"""

from __future__ import annotations

import pytest

from flax_ckpt_plugin import PREEMPTED_EXIT_CODE
from launcher import WorkerGroup

HEARTBEAT_SECS = 4
RUN_TIMEOUT = 150


@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("victim,kill_step", [(2, 20), (1, 31)])
def test_survivors_raise_peer_lost_error_within_the_heartbeat(
    tmp_path, victim, kill_step):
  with WorkerGroup("peer_lost", 3, args=[
      str(tmp_path), str(victim), str(kill_step), str(HEARTBEAT_SECS)]) as g:
    results = g.wait(RUN_TIMEOUT, check=False)
  logs = "\n".join(r.log() for r in results)
  assert results[victim].returncode == -9, logs
  for r in results:
    if r.process_id == victim:
      continue
    out = r.json
    assert out["raised"] == "PeerLostError", logs
    assert out["lost"] == {str(victim): "is gone (it stopped sending"
                                        " heartbeats)"}, logs
    assert f"process {victim} is gone" in out["message"]
    # The service declares a process dead after HEARTBEAT_SECS without
    # heartbeats; the watcher polls every 0.5 s. The slack is for this
    # shared 2-core machine running 3 JAX processes: the bar is a bound
    # far below the 300 s barrier timeout the survivors would otherwise
    # wait out.
    assert out["secs_after_kill"] < HEARTBEAT_SECS + 6, logs
    assert r.returncode == PREEMPTED_EXIT_CODE, logs
