"""The survivors' save (`rescue`), with "processes" as threads.

Each fake process keeps a local tier; one is taken for dead, and the two
others save what they hold together to the persistent tier. The local
steps are edited to give each process a different part of one array (as
one process's shards of a sharded array would be): the coverage check and
who writes which shard are the logic under test. The real multi-process
runs with a real SIGKILL are in test_survivors.py.
"""

import json

import numpy as np

from fake_coordinator import run_threads
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.manager.tier import TierManager
from flax_ckpt_plugin.tolerance import local_tier
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.tolerance import rescue
from flax_ckpt_plugin import Processes


def _local_steps(tmp_path, parts, shape):
  """Each process p saves step 4 in its local tier, holding parts[p] (a
  [start, stop)) of a global array of `shape` whose element i is i."""

  def save(coord):
    p = coord.process_index
    tier = local_tier.LocalTier(TierManager.for_this_process(
      tmp_path / f"local_{p}", "job",
      coordinator=coord))
    lo, hi = parts[p]
    tier.manager.save(4, {"w": np.arange(lo, hi, dtype=np.int32)},
                      extra={"step": 4})
    tier.manager.wait_until_finished()
    path = tier.directory / "4" / "manifest.json"
    m = json.loads(path.read_text())
    m["leaves"][0]["shape"] = list(shape)
    m["leaves"][0]["shards"][0]["index"] = [[lo, hi]]
    path.write_text(json.dumps(m))
    return tier

  return save


def _rescue(tmp_path, parts, shape, lost):
  ckpt = tmp_path / "ckpt"
  make_local = _local_steps(tmp_path, parts, shape)

  def process(coord):
    tier = make_local(coord)
    manager = TierManager(ckpt, processes=Processes(coordinator=coord))
    if coord.process_index in lost:
      return None
    r = rescue.Rescue(manager, tier, exit_code=75)
    r._save(set(lost))  # pylint: disable=protected-access
    return r.saved_step, manager.last_save_stats

  results = run_threads(len(parts), process)
  for r in results:
    if isinstance(r, BaseException):
      raise r
  return ckpt, results


def test_survivors_that_hold_every_shard_save_it_each_writing_its_own(
    tmp_path):
  # Process 2 held a replica of process 0's half.
  ckpt, results = _rescue(tmp_path, [(0, 4), (4, 8), (0, 4)], (8,), {2})
  assert [r[0] for r in results[:2]] == [4, 4]
  m = manifest_lib.read(ckpt / "4", 4)
  assert m.extra == {"step": 4} and m.scope is None
  owners = {s.index: s.file for s in m.leaves[0].shards}
  assert owners == {((0, 4),): "data/process_00000.bin",
                    ((4, 8),): "data/process_00001.bin"}
  restored = CheckpointManager(ckpt, read_only=True).restore(
      {"w": np.zeros(8, np.int32)}, 4)
  np.testing.assert_array_equal(restored["w"], np.arange(8))


def test_survivors_that_miss_a_shard_save_nothing(tmp_path):
  # Only process 2 held [8, 12).
  ckpt, results = _rescue(tmp_path, [(0, 4), (4, 8), (8, 12)], (12,), {2})
  assert [r[0] for r in results[:2]] == [None, None]
  assert not (ckpt / "4").exists()
