"""What is never finalized: a step that processes disagree about, or one whose
manifest a restore would refuse; the good step before it stays.
"""

from __future__ import annotations

import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin import SaveFailedError
from helpers import assert_only_finalized_steps
from launcher import run_workers

RUN_TIMEOUT = 120


@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_processes_that_disagree_about_a_leaf_never_finalize(tmp_path):
  """Process 1 saving `w` as bfloat16 (process 0: float32), or each process
  sharding it by another PartitionSpec, fails the save on both processes,
  naming the leaf and both views: no step that cannot be restored is
  finalized, and the good one stays (retention, max_to_keep=1, would
  delete it after a finalized save)."""
  p0, p1 = (r.json for r in run_workers(
      "hardening", 2, args=["disagree", tmp_path], timeout=RUN_TIMEOUT))
  for o in (p0, p1):
    assert set(o["errors"]) == {"dtype", "spec"}, o
    assert o["all_steps"] == [1], o
    assert o["restored"] == [1, True], o  # Bit for bit, every shard.
  dtype0, spec0 = p0["errors"]["dtype"], p0["errors"]["spec"]
  assert ("leaf 'w': process 0 (primary) saves float32[8,8], process 1 saves"
          " bfloat16[8,8]") in dtype0, dtype0
  assert "overlap" in spec0 and "process 0: " in spec0, spec0
  assert "process 1: " in spec0 and "Not finalized" in spec0, spec0
  for name in ("dtype", "spec"):  # Process 1 hears of it from the primary.
    assert p1["errors"][name].startswith("SaveFailedError"), p1["errors"]
    assert "leaf 'w'" in p1["errors"][name]
  assert_only_finalized_steps(tmp_path / "run", [1])


def test_a_manifest_over_the_read_limit_is_never_finalized(
    ckpt_dir, monkeypatch):
  """The limit is lowered (injected) to what a small state exceeds: a save
  whose manifest a restore would refuse fails instead of finalizing."""
  with CheckpointManager(ckpt_dir) as mgr:
    mgr.save(1, {"w": np.ones(3)})
    mgr.wait_until_finished()
    monkeypatch.setattr(manifest_lib, "MAX_MANIFEST_BYTES", 200)
    mgr.save(2, {"w": np.ones(3)})
    with pytest.raises(SaveFailedError, match="over the 200"):
      mgr.wait_until_finished()
    assert mgr.all_steps() == [1]
