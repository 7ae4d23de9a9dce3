"""`jax.pmap`: docs/loop.md's "With `jax.pmap`" block, run on 2 CPU devices.

A replicated TrainState has a leading device axis on every leaf; the block
saves `unreplicate(state)`, so the checkpoint holds one copy with the
model's shapes, and a resume replicates the restored copy and trains on to
the same bits as an uninterrupted run. Saved as it is, the replicated state
would hold a copy per device.
"""

import json
import pathlib
from typing import Any

from flax import jax_utils
import jax
import numpy as np

from flax_ckpt_plugin import CheckpointManager

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "loop.md"


def run_doc_block(workdir: pathlib.Path, num_steps: int) -> dict[str, Any]:
  """Runs the section's code block as a user would; its globals after."""
  section = DOC.read_text().split("## With `jax.pmap`", 1)[1]
  code = section.split("```python\n", 1)[1].split("```", 1)[0]
  scope = {"workdir": str(workdir), "num_steps": num_steps}
  exec(compile(code, "docs/loop.md", "exec"), scope)  # pylint: disable=exec-used
  return scope


def leaf_shapes(step_dir: pathlib.Path) -> dict[str, list[int]]:
  """The leaves' shapes, by key path, as the step's manifest lists them."""
  manifest = json.loads((step_dir / "manifest.json").read_text())
  return {leaf["path"]: leaf["shape"] for leaf in manifest["leaves"]}


def nbytes(tree: Any) -> int:
  return sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(tree))


def test_saves_one_copy_and_a_resume_replicates_and_trains_on_exactly(
    tmp_path, host_copy, assert_trees_equal):
  assert jax.local_device_count() == 2
  whole = run_doc_block(tmp_path / "whole", 10)
  replicated = whole["state"]
  assert replicated.params["w"].shape == (2, 8, 4)  # What pmap trained.
  one = jax_utils.unreplicate(replicated)

  # The checkpoint holds one copy: the model's shapes, one copy's bytes.
  shapes = leaf_shapes(tmp_path / "whole" / "10")
  assert shapes["params/w"] == [8, 4]
  assert shapes["opt_state/0/mu/w"] == [8, 4]
  assert shapes["step"] == []
  with CheckpointManager(tmp_path / "whole", read_only=True) as mngr:
    assert mngr.all_steps() == [5, 10]
    assert mngr.metadata(10).total_bytes == nbytes(one)
    restored = mngr.restore(whole["create_train_state"]())
  assert restored.step == 10  # A Python int, as in the target.
  assert_trees_equal(host_copy((restored.params, restored.opt_state)),
                     host_copy((one.params, one.opt_state)))

  # Stopped after step 7, run again to 10: restores 7, replicates, trains
  # steps 8-10 on both devices, and ends with the uninterrupted run's bits.
  run_doc_block(tmp_path / "resumed", 7)
  resumed = run_doc_block(tmp_path / "resumed", 10)
  assert resumed["cb"].restored_step == 7
  assert resumed["state"].params["w"].shape == (2, 8, 4)
  assert int(resumed["state"].step[1]) == 10
  assert_trees_equal(host_copy(jax_utils.unreplicate(resumed["state"])),
                     host_copy(one))

  # What saving the replicated state as it is would have stored: a copy
  # per device.
  with CheckpointManager(tmp_path / "as_is") as mngr:
    mngr.save(10, replicated)
    mngr.wait_until_finished()
    assert mngr.metadata(10).total_bytes == 2 * nbytes(one)
  assert leaf_shapes(tmp_path / "as_is" / "10")["params/w"] == [2, 8, 4]
