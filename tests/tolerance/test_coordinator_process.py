"""Any process can die, process 0 included: the coordinator in its own
process.

`flax-ckpt coordinator` runs JAX's coordination service alone; the four
real JAX trainers (2 CPU devices each) join it with
`flax_ckpt_plugin.initialize` (the launcher's `coordinator=`), so process
0 is a client like the others. Its death is then a lost peer like any
other's: the survivors save what it cannot and exit 75, and the relaunch
resumes bit-identical. The coordinator's own death ends every trainer with
75 and a message naming it, never an abort; every finalized step and the
local tiers stay, and a relaunch with a new coordinator resumes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from flax_ckpt_plugin import PREEMPTED_EXIT_CODE
from launcher import free_port
from launcher import REPO_ROOT
from launcher import run_workers
from launcher import WorkerGroup
from test_survivors import _args
from test_survivors import _local_steps
from test_survivors import _steps
from test_survivors import END
from test_survivors import HEARTBEAT
from test_survivors import LOCAL_EVERY
from test_survivors import N
from test_survivors import PERSISTENT_EVERY
from test_survivors import TIMEOUT


def _coordinator(port: int, *extra: str) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, "-m", "flax_ckpt_plugin", "coordinator", "--port",
       str(port), "--num-processes", "2", *extra], cwd=REPO_ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_coordinator_says_where_it_listens_refuses_a_port_in_use_and_stops(
):
  port = free_port()
  first = _coordinator(port, "--heartbeat-timeout", "7")
  try:
    line = ""
    while "listens on" not in line and first.poll() is None:
      line = first.stdout.readline()  # (After the runtime's own log lines.)
    assert f"listens on [::]:{port}" in line, line
    assert "2 processes" in line and "heartbeat timeout 7 s" in line, line
    second = _coordinator(port)
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 4, out
    assert f"port {port} is in use" in out, out
    first.terminate()
    rest, _ = first.communicate(timeout=60)
    assert first.returncode == 0, rest
    assert "stopped" in rest
  finally:
    first.kill()


@pytest.mark.multiprocess
@pytest.mark.timeout(3 * TIMEOUT + 60)
def test_when_process_0_dies_the_survivors_save_and_the_job_resumes(tmp_path):
  """Not elastic: process 0 SIGKILLed; the other three save the newest
  local step (all of it: each holds a replica) and exit 75; the relaunch
  of all four, with a new coordinator, ends bit-identical."""
  reference = [r.json for r in run_workers(
      "tiers", N, args=_args(tmp_path / "reference"), timeout=TIMEOUT,
      coordinator=HEARTBEAT)]
  kill_step = PERSISTENT_EVERY + 5
  run = tmp_path / "run"
  with WorkerGroup("tiers", N, args=_args(run) + [
      "0", str(kill_step), str(HEARTBEAT)], coordinator=HEARTBEAT) as g:
    results = g.wait(TIMEOUT, check=False)
    ended_at = dict(g.ended_at)
  logs = "\n".join(r.log() for r in results)
  killed_at = float((run / "killed_at").read_text())
  assert results[0].returncode == -9, logs
  for r in results[1:]:
    assert r.returncode == PREEMPTED_EXIT_CODE, logs
    assert ended_at[r.process_id] - killed_at < HEARTBEAT + 10, logs
  last_local = max(set.intersection(
      *(set(_local_steps(run, p)) for p in range(1, N))))
  persistent = _steps(run / "ckpt")
  assert persistent and persistent[-1] >= last_local, (persistent,
                                                       last_local, logs)
  resumed = [r.json for r in run_workers("tiers", N, args=_args(run),
                                         timeout=TIMEOUT,
                                         coordinator=HEARTBEAT)]
  start = resumed[0]["restored_step"]
  assert kill_step - start <= LOCAL_EVERY, (kill_step, resumed[0])
  for r, ref in zip(resumed, reference):
    assert r["restored_step"] == start
    assert r["digests"] == ref["digests"]
