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
import random
import re
import subprocess
import sys
import time

import pytest

from flax_ckpt_plugin import PREEMPTED_EXIT_CODE
import test_elastic
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


@pytest.mark.multiprocess
@pytest.mark.timeout(3 * TIMEOUT + 60)
def test_when_the_coordinator_dies_every_process_exits_75_and_the_job_resumes(
    tmp_path):
  """The coordinator SIGKILLed while the trainers run: each ends with 75
  within the heartbeat timeout + 10 s, saying `CoordinatorLostError` and
  the coordinator's address, and none aborts; every finalized step
  restores, and a relaunch with a new coordinator resumes from the newest
  local step, bit-identical to a run never interrupted."""
  reference = [r.json for r in run_workers(
      "tiers", N, args=_args(tmp_path / "reference"), timeout=TIMEOUT,
      coordinator=HEARTBEAT)]
  run = tmp_path / "run"
  kill_step = random.Random(4).randrange(LOCAL_EVERY + 1, END - LOCAL_EVERY)
  with WorkerGroup("tiers", N, args=_args(run), coordinator=HEARTBEAT) as g:
    deadline = time.monotonic() + TIMEOUT
    while max(_local_steps(run, 0), default=0) < kill_step:
      assert time.monotonic() < deadline, "the trainers never got there"
      assert all(g.running(i) for i in range(N)), g.results()
      time.sleep(0.05)
    killed_at = g.kill_coordinator()
    results = g.wait(TIMEOUT, check=False)
    ended_at = dict(g.ended_at)
  logs = "\n".join(r.log() for r in results)
  for r in results:
    assert r.returncode == PREEMPTED_EXIT_CODE, logs
    assert ended_at[r.process_id] - killed_at < HEARTBEAT + 10, logs
    assert re.search(rf"CoordinatorLostError: the coordination service at"
                     rf" 127\.0\.0\.1:{g.port} is gone", r.stderr), logs
  newest_local = max(set.intersection(
      *(set(_local_steps(run, p)) for p in range(N))))
  assert newest_local >= kill_step
  resumed = [r.json for r in run_workers("tiers", N, args=_args(run),
                                         timeout=TIMEOUT,
                                         coordinator=HEARTBEAT)]
  for r, ref in zip(resumed, reference):
    assert r["restored_step"] >= newest_local, r
    assert r["digests"] == ref["digests"]
  # Every finalized persistent step restores on its own too.
  for step in _steps(run / "ckpt"):
    from flax_ckpt_plugin import CheckpointManager  # pylint: disable=g-import-not-at-top
    with CheckpointManager(run / "ckpt", read_only=True) as manager:
      assert manager.restore(None, step=step)


ELASTIC_TRIALS = int(os.environ.get("FLAX_CKPT_PLUGIN_COORDINATOR_TRIALS",
                                    "1"))


@pytest.mark.multiprocess
@pytest.mark.timeout(test_elastic.TIMEOUT * (2 * ELASTIC_TRIALS + 1) + 60)
@pytest.mark.parametrize("layout", ["model_in", "fsdp"])
def test_when_process_0_dies_the_survivors_go_on_in_place(tmp_path, layout):
  """Elastic, process 0 SIGKILLed at a random step: on a (data, model)
  mesh, and FSDP over every device with partner copies (`replicas=1`),
  the survivors train again within the collective timeout + 5 s from
  their replica at most `local_every_steps` old, bit for bit, run to the
  end, and every persistent step restores in a fresh job as the state
  held when it was saved (the lowest survivor finalizes them).
  `FLAX_CKPT_PLUGIN_COORDINATOR_TRIALS` sets the trials (the acceptance
  run is 10)."""
  env = (dict(ELASTIC_LAYOUT="fsdp", ELASTIC_REPLICAS="1",
              DIE_DELAY_SECS="1") if layout == "fsdp"
         else dict(ELASTIC_MESH=layout))
  rng = random.Random(62)
  table = []
  for trial in range(ELASTIC_TRIALS):
    kill_step = rng.randrange(test_elastic.LOCAL_EVERY + 1,
                              test_elastic.END - 1)
    run = tmp_path / f"trial{trial}"
    reports = test_elastic._trial(run, 0, kill_step, env=env,  # pylint: disable=protected-access
                                  coordinator=test_elastic.HEARTBEAT)
    (verified,) = [r.json for r in run_workers(
        "elastic", 1, args=["verify", run], env=env,
        timeout=test_elastic.TIMEOUT)]
    steps = sorted(int(s) for s in verified)
    assert steps and steps[-1] == test_elastic.END, steps
    assert any(s > kill_step for s in steps), steps  # Saved without 0.
    for s in steps:
      held = {d for k, d in reports[0]["saved"].items()
              if k.endswith(f"/{s}")}
      assert verified[str(s)] in held, (s, verified, reports[0]["saved"])
    recovery = reports[0]["recoveries"][0]
    table.append((kill_step, recovery["step"],
                  round(max(r["recoveries"][0]["first_step_secs"]
                            for r in reports), 2)))
  print(f"{layout}: killed at, resumed at, first step after the kill (s):",
        *table, sep="\n")
