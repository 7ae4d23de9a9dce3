"""The survivors of a lost process save what it cannot, and the job resumes.

Four real JAX processes (2 CPU devices each) train a data-parallel model
(`mp_workers/tiers.py`) with a local tier every LOCAL_EVERY steps and the
persistent tier every PERSISTENT_EVERY, JAX's recoverability on. One
process SIGKILLs itself before a step's all-reduce. The survivors must end
with `PREEMPTED_EXIT_CODE` within the heartbeat timeout plus 10 s, after
saving the newest local step to the persistent tier; a relaunch of all four
then resumes and ends bit-identical to a run never interrupted, having lost
at most LOCAL_EVERY steps. `FLAX_CKPT_PLUGIN_SURVIVOR_TRIALS` sets how many
random (victim, step) trials run (1 by default; the acceptance run is 20).
"""

from __future__ import annotations

import os
import random

import pytest

from flax_ckpt_plugin import PREEMPTED_EXIT_CODE
from launcher import run_workers
from launcher import WorkerGroup

N, HEARTBEAT = 4, 4
END, PERSISTENT_EVERY, LOCAL_EVERY = 30, 10, 3
TIMEOUT = 240
TRIALS = int(os.environ.get("FLAX_CKPT_PLUGIN_SURVIVOR_TRIALS", "1"))


def _args(directory, end=END):
  return [str(directory), str(end), str(PERSISTENT_EVERY), str(LOCAL_EVERY)]


def _steps(path) -> list[int]:
  if not path.exists():
    return []
  return sorted(int(e.name) for e in path.iterdir()
                if e.name.isdigit() and (e / "_COMMITTED").exists())


def _local_steps(directory, p) -> list[int]:
  jobs = list((directory / f"local_{p}").glob("*/process_*"))
  return _steps(jobs[0]) if jobs else []


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT * (2 * TRIALS + 1) + 60)
def test_survivors_save_the_newest_local_step_and_the_job_resumes(tmp_path):
  reference = [r.json for r in run_workers(
      "tiers", N, args=_args(tmp_path / "reference"), timeout=TIMEOUT)]
  rng = random.Random(17)
  report = []
  for trial in range(TRIALS):
    victim = rng.randrange(1, N)
    kill_step = rng.randrange(PERSISTENT_EVERY + 2, END)
    run = tmp_path / f"trial{trial}"
    with WorkerGroup("tiers", N, args=_args(run) + [
        str(victim), str(kill_step), str(HEARTBEAT)]) as g:
      results = g.wait(TIMEOUT, check=False)
      ended_at = dict(g.ended_at)
    logs = "\n".join(r.log() for r in results)
    killed_at = float((run / "killed_at").read_text())
    assert results[victim].returncode == -9, logs
    for r in results:
      if r.process_id == victim:
        continue
      assert r.returncode == PREEMPTED_EXIT_CODE, logs
      assert ended_at[r.process_id] - killed_at < HEARTBEAT + 10, logs
    survivors = [p for p in range(N) if p != victim]
    last_local = max(set.intersection(
        *(set(_local_steps(run, p)) for p in survivors)))
    persistent = _steps(run / "ckpt")
    assert persistent and persistent[-1] >= last_local, (persistent,
                                                         last_local, logs)

    resumed = [r.json for r in run_workers("tiers", N, args=_args(run),
                                           timeout=TIMEOUT)]
    start = resumed[0]["restored_step"]
    assert kill_step - start <= LOCAL_EVERY, (kill_step, resumed[0])
    for r, ref in zip(resumed, reference):
      assert r["restored_step"] == start
      assert r["digests"] == ref["digests"]
    report.append((victim, kill_step, start, resumed[0]["restored_tier"],
                   max(ended_at[p] - killed_at for p in survivors)))
  print("victim, killed at, resumed at, tier, last survivor ended after (s):",
        *report, sep="\n")


@pytest.mark.multiprocess
@pytest.mark.timeout(3 * TIMEOUT)
def test_when_process_0_dies_a_relaunch_restores_from_the_local_tiers(
    tmp_path):
  """JAX ends every process when process 0 (its coordination service) dies:
  nothing can be saved then, and the local tiers serve the relaunch."""
  kill_step = 20
  reference = [r.json for r in run_workers(
      "tiers", N, args=_args(tmp_path / "reference"), timeout=TIMEOUT)]
  run = tmp_path / "run"
  with WorkerGroup("tiers", N, args=_args(run) + [
      "0", str(kill_step), str(HEARTBEAT)]) as g:
    results = g.wait(TIMEOUT, check=False)
  logs = "\n".join(r.log() for r in results)
  assert all(r.returncode != 0 for r in results), logs
  held = [set(_local_steps(run, p)) for p in range(N)]
  last_local = max(set.intersection(*held))
  assert _steps(run / "ckpt")[-1] < last_local  # Only the local tier has it.
  # A process may have finished its local save of a newer step before JAX
  # ended it, and another not (on a loaded machine): the holders then
  # serve that step to the others (every process holds a replica).
  newest = max(set.union(*held))

  resumed = [r.json for r in run_workers("tiers", N, args=_args(run),
                                         timeout=TIMEOUT)]
  for r, ref in zip(resumed, reference):
    assert (r["restored_step"], r["restored_tier"]) == (
        newest, "local" if newest == last_local else "peer")
    assert kill_step - r["restored_step"] <= LOCAL_EVERY
    assert r["persistent_restores"] == 0
    assert r["digests"] == ref["digests"]
