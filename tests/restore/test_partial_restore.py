"""Restoring part of a checkpoint: the params of a saved TrainState for
evaluation, or with a new head for fine-tuning."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import StructureMismatchError


def _nbytes(tree) -> int:
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


@pytest.fixture
def saved(ckpt_dir, make_state):
  state = make_state(seed=3)
  with CheckpointManager(ckpt_dir) as m:
    m.save(7, state)
  return state


def test_the_params_of_a_train_state_restore_alone_reading_only_their_bytes(
    ckpt_dir, saved, make_state):
  target = {"params": jax.tree.map(jnp.zeros_like, make_state().params)}
  with CheckpointManager(ckpt_dir) as m:
    restored = m.restore(target, partial=True)
    read = m.last_restore_stats.nbytes_read
  jax.tree.map(np.testing.assert_array_equal, restored["params"],
               saved.params)
  # The Adam moments and the step were not read: not a byte.
  assert read == _nbytes(saved.params)
  assert _nbytes(saved) > 2 * read


def test_without_partial_the_other_leaves_are_a_mismatch_that_names_it(
    ckpt_dir, saved, make_state):
  del saved
  with CheckpointManager(ckpt_dir) as m:
    with pytest.raises(StructureMismatchError, match=r"opt_state.*partial=True"):
      m.restore({"params": make_state().params})


def test_a_new_head_keeps_its_value_and_is_named_in_the_log(
    ckpt_dir, saved, make_state, caplog):
  params = dict(make_state().params)
  head = {"kernel": jnp.full((4, 2), 0.5), "bias": jnp.ones(2)}
  target = {"params": {**params, "new_head": head}}
  with CheckpointManager(ckpt_dir) as m:
    with pytest.raises(StructureMismatchError,
                       match=r"params/new_head/bias.*missing='keep'"):
      m.restore(target, partial=True)
    restored = m.restore(target, partial=True, missing="keep")
  jax.tree.map(np.testing.assert_array_equal, restored["params"]["new_head"],
               head)
  for name in params:
    jax.tree.map(np.testing.assert_array_equal, restored["params"][name],
                 saved.params[name])
  assert "keep the target's values: ['params/new_head/bias'," in caplog.text


def test_an_abstract_leaf_the_checkpoint_lacks_has_no_value_to_keep(
    ckpt_dir, saved):
  del saved
  target = {"params": {"extra": jax.ShapeDtypeStruct((3,), jnp.float32)}}
  with CheckpointManager(ckpt_dir) as m:
    with pytest.raises(StructureMismatchError,
                       match=r"params/extra.*give them a value to keep"):
      m.restore(target, partial=True, missing="keep")
    with pytest.raises(ValueError, match="missing must be one of"):
      m.restore(target, partial=True, missing="zeros")


def test_the_restoring_doc_example_runs_as_shown(tmp_path, capsys):
  """docs/restoring.md's block under "Restoring part of a checkpoint"."""
  doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" /
         "restoring.md").read_text()
  section = doc.split("## Restoring part of a checkpoint", 1)[1]
  code = section.split("```python\n", 1)[1].split("```", 1)[0]
  scope = {"workdir": str(tmp_path / "run")}
  exec(compile(code, "docs/restoring.md", "exec"), scope)  # pylint: disable=exec-used
  assert capsys.readouterr().out.strip() == "64 bytes read"
  assert set(scope["tuned"]["params"]) == {"encoder", "head"}
  np.testing.assert_array_equal(scope["evaluated"]["params"]["encoder"][
      "kernel"], np.ones((4, 4)))
