"""Renaming on restore: a checkpoint's leaves restored under other paths
(`restore(..., rename=)`), by rules of regular expressions or a function,
with partial restores, casts, and messages that name both paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import StructureMismatchError
from flax_ckpt_plugin.restore.renaming import RenameError
from launcher import run_workers

# An old model: two Dense layers auto-named by linen, and a head.
OLD = {
    "params": {
        "Dense_0": {"kernel": np.arange(12, dtype=np.float32).reshape(3, 4),
                    "bias": np.full(4, 0.5, np.float32)},
        "Dense_1": {"kernel": np.ones((4, 2), np.float32),
                    "bias": np.zeros(2, np.float32)},
        "head": {"w": np.full(2, 7, np.float32)},
    },
    "step": 11,
}
# The code since: the layers named `encoder/layer_N`, and no head.
RULES = {r"params/Dense_(\d+)/(.*)": r"params/encoder/layer_\1/\2",
         r"params/head/.*": None}


def _new(dtype=jnp.float32):
  return {"params": {"encoder": {
      f"layer_{i}": {"kernel": jnp.zeros(OLD["params"][f"Dense_{i}"][
          "kernel"].shape, dtype),
                     "bias": jnp.zeros(OLD["params"][f"Dense_{i}"][
                         "bias"].shape, dtype)} for i in (0, 1)}},
          "step": 0}


@pytest.fixture
def saved(ckpt_dir):
  with CheckpointManager(ckpt_dir) as m:
    m.save(11, OLD)
  return ckpt_dir


def _check_values(restored, dtype=np.float32):
  for i in (0, 1):
    for name in ("kernel", "bias"):
      got = np.asarray(restored["params"]["encoder"][f"layer_{i}"][name])
      assert got.dtype == dtype
      np.testing.assert_array_equal(got, OLD["params"][f"Dense_{i}"][name])


def test_rules_restore_renamed_layers_and_drop_the_old_head(saved):
  with CheckpointManager(saved) as m:
    restored = m.restore(_new(), rename=RULES)
    read = m.last_restore_stats.nbytes_read
  _check_values(restored)
  assert restored["step"] == 11  # No rule matches 'step': kept as it is.
  # The dropped head is not read: only the layers' bytes.
  assert read == sum(v.nbytes for k, layer in OLD["params"].items()
                     if k != "head" for v in layer.values())


def test_restore_newest_valid_renames_too(saved):
  """The resume path: the newest step that restores everywhere, renamed."""
  with CheckpointManager(saved) as m:
    step, restored = m.restore_newest_valid(_new(), rename=RULES)
  assert step == 11
  _check_values(restored)


def test_a_function_renames_as_the_rules_do(saved):
  def rename(path):
    if path.startswith("params/head/"):
      return None
    return path.replace("params/Dense_", "params/encoder/layer_")

  with CheckpointManager(saved) as m:
    _check_values(m.restore(_new(), rename=rename))


def test_the_first_rule_that_matches_the_whole_path_wins(saved):
  rules = {r"params/Dense_0/kernel": "params/encoder/layer_0/kernel",
           r"params/Dense_(\d+)/(.*)": r"params/encoder/layer_\1/\2",
           r"Dense_1": "never",  # Matches part of paths only: no effect.
           r"params/head/w": None}
  with CheckpointManager(saved) as m:
    _check_values(m.restore(_new(), rename=rules))
    # A sequence of pairs is read the same way, in order.
    _check_values(m.restore(_new(), rename=list(rules.items())))


def test_a_mismatch_names_the_target_path_and_the_checkpoint_path(saved):
  target = _new()
  target["params"]["encoder"]["layer_1"]["kernel"] = jnp.zeros((4, 3))
  del target["params"]["encoder"]["layer_0"]["bias"]
  with CheckpointManager(saved) as m:
    with pytest.raises(StructureMismatchError) as e:
      m.restore(target, rename=RULES)
  text = str(e.value)
  assert ("checkpoint leaves not in the target:"
          " ['params/encoder/layer_0/bias' (checkpoint"
          " 'params/Dense_0/bias')]") in text
  assert ("leaf 'params/encoder/layer_1/kernel' (checkpoint"
          " 'params/Dense_1/kernel'): checkpoint has float32[4,2], target"
          " has float32[4,3]") in text


def test_a_mismatch_names_the_rules_that_matched_no_path(ckpt_dir):
  """A prefix written as for `re.sub` renames nothing, since a rule
  matches whole paths: the mismatch names that rule, says it matched no
  path and how it would; a rule that matched is not named."""
  with CheckpointManager(ckpt_dir) as m:
    m.save(1, {"encoder": {"kernel": np.ones((2, 3), np.float32)},
               "head": {"w": np.zeros(3, np.float32)}})
  target = {"backbone": {"kernel": jnp.zeros((2, 3))},
            "out": {"w": jnp.zeros(3)}}
  rules = {r"^encoder/": "backbone/", r"head/(.*)": r"out/\1"}
  with CheckpointManager(ckpt_dir) as m:
    with pytest.raises(StructureMismatchError) as e:
      m.restore(target, rename=rules)
    text = str(e.value)
    assert ("target leaves not in the checkpoint: ['backbone/kernel']"
            in text)
    assert ("rename rules that matched no checkpoint path: '^encoder/' ->"
            " 'backbone/' (it matches the start of 'encoder/kernel', as"
            " re.match reads a pattern; '^encoder/(.*)' -> r'backbone/\\1'"
            " matches it whole)") in text
    assert ("a rule's pattern matches a whole checkpoint path"
            " (re.fullmatch), as r'encoder/(.*)' -> r'backbone/\\1'"
            " renames 'encoder/x' to 'backbone/x'") in text
    assert "head/" not in text.split("rename rules")[1]

    # The rule the message gives restores.
    rules = {r"^encoder/(.*)": r"backbone/\1", r"head/(.*)": r"out/\1"}
    restored = m.restore(target, rename=rules)
  np.testing.assert_array_equal(restored["backbone"]["kernel"],
                                np.ones((2, 3)))


def test_a_rule_that_matches_inside_paths_says_so(saved):
  """A rule without `^` that matches within paths only: named with the
  path it matches inside; the general form follows."""
  with CheckpointManager(saved) as m:
    with pytest.raises(StructureMismatchError) as e:
      m.restore(_new(), rename={"Dense_": "encoder/layer_",
                                r"params/head/.*": None})
  text = str(e.value)
  assert ("rename rules that matched no checkpoint path: 'Dense_' ->"
          " 'encoder/layer_' (it matches inside 'params/Dense_0/bias', as"
          " re.search reads a pattern); a rule's pattern matches a whole"
          " checkpoint path (re.fullmatch)") in text
  assert "params/head" not in text.split("rename rules")[1]


def test_a_mismatch_with_every_rule_matched_names_no_rule(saved):
  target = _new()
  target["params"]["encoder"]["layer_1"]["kernel"] = jnp.zeros((4, 3))
  with CheckpointManager(saved) as m:
    with pytest.raises(StructureMismatchError) as e:
      m.restore(target, rename=RULES)
  assert "rename rule" not in str(e.value)
  assert "fullmatch" not in str(e.value)


def test_with_partial_and_cast(saved):
  """Only the first layer, in bfloat16: renamed, partial and cast at once;
  the other leaves are not read."""
  target = {"params": {"encoder": {"layer_0": {
      "kernel": jax.ShapeDtypeStruct((3, 4), jnp.bfloat16),
      "bias": jax.ShapeDtypeStruct((4,), jnp.bfloat16)}}}}
  with CheckpointManager(saved) as m:
    with pytest.raises(StructureMismatchError,
                       match=r"'params/encoder/layer_0/kernel' \(checkpoint"
                       r" 'params/Dense_0/kernel'\).*cast=True\) converts"):
      m.restore(target, rename=RULES, partial=True)
    restored = m.restore(target, rename=RULES, partial=True, cast=True)
    read = m.last_restore_stats.nbytes_read
  layer = restored["params"]["encoder"]["layer_0"]
  assert layer["kernel"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(layer["kernel"], np.float32),
                                OLD["params"]["Dense_0"]["kernel"])
  np.testing.assert_array_equal(np.asarray(layer["bias"], np.float32),
                                OLD["params"]["Dense_0"]["bias"])
  assert read == 12 * 4 + 4 * 4


def test_a_sharded_target_reads_its_regions_under_the_new_names(saved):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      None, "x"))
  target = {"params": {"encoder": {"layer_0": {
      "kernel": jax.ShapeDtypeStruct((3, 4), jnp.float32,
                                     sharding=sharding)}}}}
  with CheckpointManager(saved) as m:
    restored = m.restore(target, rename=RULES, partial=True)
  kernel = restored["params"]["encoder"]["layer_0"]["kernel"]
  assert kernel.sharding == sharding
  for shard in kernel.addressable_shards:
    np.testing.assert_array_equal(
        np.asarray(shard.data),
        OLD["params"]["Dense_0"]["kernel"][shard.index])


def test_without_a_target_the_step_comes_back_under_the_new_names(saved):
  with CheckpointManager(saved) as m:
    plain = m.restore(None, rename=RULES)
  assert set(plain) == {"params", "step"}
  assert set(plain["params"]) == {"encoder"}
  _check_values(plain)


def test_two_leaves_renamed_to_one_path_are_refused_naming_both(saved):
  with CheckpointManager(saved) as m:
    with pytest.raises(RenameError,
                       match=r"'params/Dense_0/bias' and 'params/Dense_1/bias'"
                       r" the same target path 'params/bias'"):
      m.restore(None, rename={r"params/Dense_\d/(.*)": r"params/\1"})


@pytest.mark.parametrize("order", [1, -1])
def test_a_leaf_renamed_into_another_leaf_is_refused_naming_both(saved,
                                                                 order):
  """'x' and 'x/y' cannot both be leaves, in whichever order the rules
  come."""
  rules = [(r"params/Dense_0/bias", "params/x"),
           (r"params/Dense_0/kernel", "params/x/y")][::order]
  with CheckpointManager(saved) as m:
    for target in (None, "tree"):
      with pytest.raises(RenameError, match=r"'params/x/y' inside it"):
        m.restore(None if target is None else {"params": {"x": 0}},
                  rename=rules, partial=target is not None)


@pytest.mark.parametrize("rename, message", [
    ({"(": "x"}, r"rename rule '\(': not a regular expression"),
    ({"params/(.*)": r"\2"}, r"rename rule 'params/\(\.\*\)' -> '\\\\2' on"),
    ({"params/(.*)": 3}, r"the replacement a string or None, got 3"),
    (lambda path: "", r"the rename function gives checkpoint leaf"),
    ({"params/(.*)": r"p//\1"}, r"non-empty names between slashes"),
])
def test_a_wrong_rename_is_a_value_error_naming_the_rule(saved, rename,
                                                          message):
  with CheckpointManager(saved) as m:
    with pytest.raises(ValueError, match=message):
      m.restore(None, rename=rename)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_restore_together_renames_and_reads_each_byte_once(tmp_path):
  """2 processes hold the renamed layer (split within each, replicated
  across them): `restore_together(rename=)` reads the kernel once in all
  (the 256-byte bias, too small to share, on each), and a rename that
  gives two leaves one path fails on both, naming them, as does a rule
  that matches no path whole."""
  results = run_workers("rename_together", 2, args=[tmp_path / "ckpt"],
                        timeout=120)
  out = [r.json for r in results]
  assert [o["same"] for o in out] == [True, True], [r.log() for r in results]
  assert sum(o["nbytes"] for o in out) == out[0]["kernel_bytes"] + 2 * 256
  for o in out:
    assert "the same target path 'x'" in o["error"], o
    assert ("rename rules that matched no checkpoint path:"
            " '^params/Dense_0/' -> 'params/encoder/layer_0/' (it matches"
            " the start of 'params/Dense_0/bias'") in o["unmatched"], o
    assert "params/head" not in o["unmatched"].split("rename rules")[1]
