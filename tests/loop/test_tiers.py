"""Restoring from the fastest tier, in real multi-process runs.

Real JAX processes (each with 2 CPU devices) train a data-parallel model
whose shards every process holds a replica of (`mp_workers/tiers.py`); each
has a local tier of its own (a per-host path) under the shared persistent
one. Runs are compared bit for bit with a run that was never interrupted.
"""

from __future__ import annotations

import shutil

import pytest

from flax_ckpt_plugin import PREEMPTED_EXIT_CODE
from launcher import run_workers
from launcher import WorkerGroup

TIMEOUT = 120
END, PERSISTENT_EVERY, LOCAL_EVERY = 12, 5, 2


def _run(directory, end, n, env=None):
  return [r.json for r in run_workers(
      "tiers", n, args=[str(directory), str(end), str(PERSISTENT_EVERY),
                        str(LOCAL_EVERY)], env=env, timeout=TIMEOUT)]


@pytest.mark.multiprocess
@pytest.mark.timeout(8 * TIMEOUT)
def test_a_restart_restores_from_local_tiers_then_peers_then_persistent(
    tmp_path):
  n = 4  # The acceptance setup: 4 processes x 2 CPU devices.
  reference = _run(tmp_path / "reference", END, n)
  run = tmp_path / "run"
  first = _run(run, 9, n)  # Persistent: 5; local: 6 and 8.
  assert [r["restored_tier"] for r in first] == [None] * n
  # The local tier belongs to the checkpoint directory by its path: each
  # case starts from a copy of this run, put back at the same path.
  shutil.copytree(run, tmp_path / "after_9")

  def again():
    shutil.rmtree(run)
    shutil.copytree(tmp_path / "after_9", run)

  resumed = _run(run, END, n)
  for r, ref in zip(resumed, reference):
    assert (r["restored_step"], r["restored_tier"]) == (8, "local")
    assert r["restored_extra"] == {"step": 8}
    assert r["persistent_restores"] == 0
    assert r["digests"] == ref["digests"]

  # A replaced host: process 1's local tier is gone; the others hold a
  # replica of every shard, so process 1 gets them from them, and nothing is
  # read from the persistent tier.
  again()
  shutil.rmtree(run / "local_1")
  resumed = _run(run, END, n)
  for r, ref in zip(resumed, reference):
    assert (r["restored_step"], r["restored_tier"]) == (8, "peer"), r
    assert r["restored_extra"] == {"step": 8}
    assert r["persistent_restores"] == 0
    assert r["digests"] == ref["digests"]

  # Every local tier gone: the persistent tier serves.
  again()
  for p in range(n):
    shutil.rmtree(run / f"local_{p}")
  resumed = _run(run, END, n)
  for r, ref in zip(resumed, reference):
    assert (r["restored_step"], r["restored_tier"]) == (5, "persistent")
    assert r["persistent_restores"] == 1
    assert r["digests"] == ref["digests"]


@pytest.mark.multiprocess
@pytest.mark.timeout(4 * TIMEOUT)
def test_a_lost_host_with_its_disk_restores_from_partner_copies(tmp_path):
  """The state split over all 8 devices (each shard held by one process),
  with `replicas=1`. Process 1 is killed after step 9 (local steps 6 and
  8), and its local directory goes with its host. The survivors save
  their newest local step to the persistent tier, the lost shards too
  (from the partner copies), and exit for a relaunch; the relaunch of all
  four restores step 8 from the partners' and their own local tiers
  ("peer"), reads nothing of the persistent tier, and ends bit-identical
  to a run that was never interrupted."""
  n, env = 4, {"TIERS_REPLICAS": "1"}
  reference = _run(tmp_path / "reference", END, n, env)
  run = tmp_path / "run"
  with WorkerGroup("tiers", n, env=dict(env, WORKER_XLA_FLAGS=(
      "--xla_cpu_collective_timeout_seconds=8")), args=[
          str(run), str(END), str(PERSISTENT_EVERY), str(LOCAL_EVERY), "1",
          "10", "3"]) as g:
    killed = g.wait(TIMEOUT, check=False)
  logs = "\n".join(r.log() for r in killed)
  assert killed[1].returncode == -9, logs
  assert all(r.returncode == PREEMPTED_EXIT_CODE for r in killed
             if r.process_id != 1), logs
  # The survivors' save held every shard: the lost ones from partners.
  assert (run / "ckpt" / "8").is_dir(), (sorted(
      p.name for p in (run / "ckpt").iterdir()), logs)
  shutil.rmtree(run / "local_1")
  resumed = _run(run, END, n, env)
  for r, ref in zip(resumed, reference):
    assert (r["restored_step"], r["restored_tier"]) == (8, "peer"), r
    assert r["persistent_restores"] == 0
    assert r["digests"] == ref["digests"]
