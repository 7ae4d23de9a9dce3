"""`load_safetensors`: published weights (files the `safetensors` package
wrote, one or sharded with the hub's index) read into a target, renamed,
cast, onto the target's shardings, each process reading its own regions.

The GPT-2 tensors and their Flax names are `tests/mp_workers/_gpt2.py`'s.
"""

import importlib.util
import json
import logging
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file
from safetensors.numpy import save_file

import flax_ckpt_plugin
from flax_ckpt_plugin import CheckpointCorruptedError
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import load_safetensors
from flax_ckpt_plugin import StructureMismatchError
from launcher import MP_WORKERS
from launcher import run_workers

# The workers' helper, loaded from its file (the workers' folder is not
# put on this process's path).
_SPEC = importlib.util.spec_from_file_location("_gpt2",
                                               MP_WORKERS / "_gpt2.py")
_gpt2 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_gpt2)

SMALL = {"width": 64, "layers": 12, "vocab": 1000, "positions": 128}


def _nest(flat):
  root = {}
  for path, leaf in flat.items():
    node = root
    *head, last = path.split("/")
    for k in head:
      node = node.setdefault(k, {})
    node[last] = leaf
  return root


def _flat(tree):
  return {"/".join(str(k.key) for k in kp): leaf for kp, leaf in
          jax.tree_util.tree_flatten_with_path(tree)[0]}


def _sharded_target(shapes, dtype=jnp.float32):
  """Abstract leaves split over the 2 devices along their first even axis."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))

  def spec(shape):
    for axis, d in enumerate(shape):
      if d % 2 == 0:
        return jax.sharding.PartitionSpec(*([None] * axis + ["x"]))
    return jax.sharding.PartitionSpec()

  return _nest({p: jax.ShapeDtypeStruct(
      s, dtype, sharding=jax.sharding.NamedSharding(mesh, spec(s)))
                for p, s in shapes.items()})


def _reference(folder):
  """`safetensors.numpy.load_file` of every file, under the Flax names."""
  out = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      for tensor, value in load_file(os.path.join(folder, name)).items():
        if _gpt2.flax_path(tensor) is not None:
          out[_gpt2.flax_path(tensor)] = value
  return out


def _bytes_read(caplog) -> int:
  """What the last load's log line says it read."""
  lines = [r for r in caplog.records if " bytes of " in r.getMessage()
           and "] safetensors " in r.getMessage()]
  return lines[-1].args[1]


@pytest.mark.parametrize("flavour", ["numpy", "flax"])
@pytest.mark.parametrize("files", [1, 3])
def test_gpt2_weights_load_onto_a_sharded_target_bit_for_bit(tmp_path,
                                                             flavour, files):
  """GPT-2's tensor names (and its mask buffers, dropped by the rename),
  written by the safetensors package, one file or 3 with an index."""
  _gpt2.write(tmp_path, files=files, flavour=flavour, mask=True, **SMALL)
  assert ((tmp_path / "model.safetensors.index.json").exists()
          == (files > 1))
  target = _sharded_target(_gpt2.flax_shapes(**SMALL))
  loaded = load_safetensors(tmp_path, target, rename=_gpt2.RENAME)
  flat, want = _flat(loaded), _reference(tmp_path)
  assert sorted(flat) == sorted(want)
  assert "params/h_11/attn/c_attn/kernel" in flat
  for path, arr in flat.items():
    assert arr.sharding == _flat(target)[path].sharding, path
    for shard in arr.addressable_shards:
      assert (np.asarray(shard.data).tobytes()
              == want[path][shard.index].tobytes()), path


def test_a_file_an_index_or_a_folder_name_the_same_tensors(tmp_path):
  _gpt2.write(tmp_path / "sharded", files=2, **SMALL)
  _gpt2.write(tmp_path / "one", files=1, **SMALL)
  target = _nest({p: jax.ShapeDtypeStruct(s, jnp.float32)
                  for p, s in _gpt2.flax_shapes(**SMALL).items()})
  loads = [load_safetensors(path, target, rename=_gpt2.RENAME) for path in (
      tmp_path / "sharded", tmp_path / "sharded" /
      "model.safetensors.index.json", tmp_path / "one",
      tmp_path / "one" / "model.safetensors")]
  for other in loads[1:]:
    jax.tree.map(np.testing.assert_array_equal, loads[0], other)


def test_the_hub_cache_layout_loads_and_links_elsewhere_are_refused(
    tmp_path):
  """The hub's cache: `<repo>/snapshots/<revision>/` holds links to
  `<repo>/blobs/`. A link that leads out of that repository (here to
  another folder's weights) is refused, naming the file."""
  tensors = {"a": np.arange(6, dtype=np.float32), "b": np.ones(3, np.int8)}
  repo = tmp_path / "models--org--name"
  (repo / "blobs").mkdir(parents=True)
  save_file(tensors, str(repo / "blobs" / "0123abcd"))
  revision = repo / "snapshots" / "fedcba98"
  revision.mkdir(parents=True)
  os.symlink("../../blobs/0123abcd", revision / "model.safetensors")
  plain = load_safetensors(revision, None)
  np.testing.assert_array_equal(plain["a"], tensors["a"])
  np.testing.assert_array_equal(plain["b"], tensors["b"])
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  save_file(tensors, str(elsewhere / "other.safetensors"))
  folder = tmp_path / "folder"
  folder.mkdir()
  os.symlink(elsewhere / "other.safetensors", folder / "model.safetensors")
  with pytest.raises(CheckpointCorruptedError, match="model.safetensors"):
    load_safetensors(folder, None)


def test_without_a_target_the_tensors_come_back_as_nested_numpy(tmp_path):
  tensors = {"a.b": np.arange(6, dtype=np.int16).reshape(2, 3),
             "a.c": np.ones(2, ml_dtypes.bfloat16), "d": np.array(3, np.float32)}
  save_file(tensors, str(tmp_path / "model.safetensors"))
  plain = load_safetensors(tmp_path, None)
  assert set(plain) == {"a", "d"}
  np.testing.assert_array_equal(plain["a"]["b"], tensors["a.b"])
  assert plain["a"]["c"].dtype == ml_dtypes.bfloat16
  assert plain["d"].shape == () and plain["d"] == 3
  renamed = load_safetensors(tmp_path, None, rename={r"a/(.*)": r"x/\1",
                                                     "d": None})
  assert set(renamed) == {"x"} and set(renamed["x"]) == {"b", "c"}


def test_a_rename_rule_that_matched_no_tensor_is_named(tmp_path):
  """A prefix rule, as `re.sub` takes it, renames no tensor: the mismatch
  says so, with the rule that matches whole paths."""
  save_file({"h.0.w": np.ones(2, np.float32), "h.1.w": np.ones(2, np.float32)},
            str(tmp_path / "model.safetensors"))
  target = {"blocks": {"0": {"w": jnp.zeros(2)}, "1": {"w": jnp.zeros(2)}}}
  with pytest.raises(StructureMismatchError) as e:
    load_safetensors(tmp_path, target, rename={"^h/": "blocks/"})
  text = str(e.value)
  assert ("rename rules that matched no checkpoint path: '^h/' -> 'blocks/'"
          " (it matches the start of 'h/0/w', as re.match reads a pattern;"
          " '^h/(.*)' -> r'blocks/\\1' matches it whole); a rule's pattern"
          " matches a whole checkpoint path (re.fullmatch)") in text
  loaded = load_safetensors(tmp_path, target,
                            rename={"^h/(.*)": r"blocks/\1"})
  np.testing.assert_array_equal(loaded["blocks"]["1"]["w"], np.ones(2))


def test_missing_and_unexpected_leaves_are_named_in_one_error(tmp_path):
  _gpt2.write(tmp_path, **SMALL)
  shapes = _gpt2.flax_shapes(**SMALL)
  shapes["params/lm_head/kernel"] = (SMALL["width"], SMALL["vocab"])
  del shapes["params/wpe/embedding"]
  target = _nest({p: jax.ShapeDtypeStruct(s, jnp.float32)
                  for p, s in shapes.items()})
  with pytest.raises(StructureMismatchError) as e:
    load_safetensors(tmp_path, target, rename=_gpt2.RENAME)
  text = str(e.value)
  assert ("target leaves not in the checkpoint: ['params/lm_head/kernel']"
          " (load_safetensors(..., missing='keep')") in text
  assert ("checkpoint leaves not in the target: ['params/wpe/embedding'"
          " (checkpoint 'wpe/weight')] (load_safetensors(..., partial=True)"
          in text)
  assert str(tmp_path) in text

  # Ignored and kept where asked: a new head keeps its value.
  head = jnp.full(shapes["params/lm_head/kernel"], 0.25)
  target["params"]["lm_head"]["kernel"] = head
  loaded = load_safetensors(tmp_path, target, rename=_gpt2.RENAME,
                            partial=True, missing="keep")
  assert loaded["params"]["lm_head"]["kernel"] is head
  np.testing.assert_array_equal(loaded["params"]["h_3"]["mlp"]["c_fc"]
                                ["kernel"], _reference(tmp_path)[
                                    "params/h_3/mlp/c_fc/kernel"])


def test_casts_convert_as_restore_does_and_lossy_ones_name_the_leaf(tmp_path):
  f32 = np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6)
  save_file({"w": f32, "n": np.array([1, 300], np.int32)},
            str(tmp_path / "model.safetensors"))
  target = {"w": jax.ShapeDtypeStruct((4, 6), jnp.bfloat16),
            "n": jax.ShapeDtypeStruct((2,), jnp.int16)}
  with pytest.raises(StructureMismatchError,
                     match=r"load_safetensors\(\.\.\., cast=True\) converts"):
    load_safetensors(tmp_path, target)
  loaded = load_safetensors(tmp_path, target, cast=True)
  assert loaded["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(loaded["w"]),
                                f32.astype(ml_dtypes.bfloat16))
  np.testing.assert_array_equal(np.asarray(loaded["n"]), [1, 300])
  # Floating to integer drops fractions: refused, naming the leaf.
  with pytest.raises(StructureMismatchError,
                     match=r"leaf 'w': checkpoint has float32\[4,6\], target"
                     r" has int32\[4,6\]: cast=True converts floating to"
                     r" floating and integer to integer dtypes only"):
    load_safetensors(tmp_path, {"w": jax.ShapeDtypeStruct((4, 6), jnp.int32),
                                "n": target["n"]}, cast=True)
  # A value the narrower integer cannot hold.
  with pytest.raises(StructureMismatchError,
                     match=r"leaf 'n'.*cannot hold the saved value 300"):
    load_safetensors(tmp_path, {"w": target["w"],
                                "n": jax.ShapeDtypeStruct((2,), jnp.int8)},
                     cast=True)


def test_only_the_bytes_of_the_target_leaves_are_read(tmp_path, caplog):
  _gpt2.write(tmp_path, files=3, **SMALL)
  shapes = _gpt2.flax_shapes(**SMALL)
  wanted = {p: s for p, s in shapes.items() if p.startswith("params/h_5/")}
  caplog.set_level(logging.INFO, logger="flax_ckpt_plugin")
  loaded = load_safetensors(tmp_path, _sharded_target(wanted),
                            rename=_gpt2.RENAME, partial=True)
  assert _bytes_read(caplog) == sum(4 * int(np.prod(s))
                                    for s in wanted.values())
  want = _reference(tmp_path)
  for path, arr in _flat(loaded).items():
    np.testing.assert_array_equal(np.asarray(arr), want[path])


def test_an_export_loads_back_into_its_tree_without_a_rename(
    tmp_path, make_state):
  state = make_state(seed=2)
  with CheckpointManager(tmp_path / "ckpt") as m:
    m.save(1, state)
  flax_ckpt_plugin.export(tmp_path / "ckpt", tmp_path / "out",
                          only=["params"])
  loaded = load_safetensors(tmp_path / "out", {"params": state.params})
  jax.tree.map(np.testing.assert_array_equal, loaded["params"], state.params)


def test_damaged_files_are_named(tmp_path):
  save_file({"a.w": np.ones((64, 64), np.float32)},
            str(tmp_path / "model.safetensors"))
  target = {"a": {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}}
  path = tmp_path / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[:-100])  # Truncated.
  with pytest.raises(CheckpointCorruptedError,
                     match=rf"safetensors file {path}, tensor 'a.w': bytes"
                     r" \[\d+, \d+\) lie past the file's end"):
    load_safetensors(path, target)
  path.write_bytes(b"\xff" * 8 + data[8:])
  with pytest.raises(CheckpointCorruptedError,
                     match=rf"safetensors file {path}: its header length"):
    load_safetensors(path, target)
  path.write_bytes(data)

  index = tmp_path / "model.safetensors.index.json"
  index.write_text(json.dumps({"weight_map": {
      "a.w": "model.safetensors", "a.b": "model.safetensors"}}))
  with pytest.raises(CheckpointCorruptedError,
                     match=r"tensor 'a.b' is in model.safetensors by its"
                     " weight_map, and not in that file's header"):
    load_safetensors(tmp_path, target)
  index.write_text(json.dumps({"weight_map": {"a.w": "model-2.safetensors"}}))
  with pytest.raises(FileNotFoundError,
                     match=r"model-2.safetensors, named by .*index.json,"
                     " does not exist"):
    load_safetensors(tmp_path, target)
  index.write_text(json.dumps({"weight_map": {"a.w": "../x.safetensors"}}))
  with pytest.raises(CheckpointCorruptedError,
                     match="not a file name in the index's folder"):
    load_safetensors(tmp_path, target)
  with pytest.raises(FileNotFoundError, match="no safetensors file or folder"):
    load_safetensors(tmp_path / "nothing", target)
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="holds no"):
    load_safetensors(tmp_path / "empty", target)


RUN_TIMEOUT = 150


@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_gpt2_small_on_4_processes_reads_each_share_once(tmp_path):
  """GPT-2 small (124M parameters, 498 MB in float32) in 3 files, loaded
  onto 4 processes x 2 devices, every leaf split over the 8 devices (the
  embedding of 50257 rows by its columns): each process reads at most 1.1x
  the bytes of the regions its devices hold, and every shard is bit for
  bit `safetensors.numpy.load_file` under the rename."""
  folder = tmp_path / "gpt2"
  _gpt2.write(folder, files=3)
  results = run_workers(
      "safetensors_load", 4, timeout=RUN_TIMEOUT,
      args=[folder, _gpt2.WIDTH, _gpt2.LAYERS, _gpt2.VOCAB, _gpt2.POSITIONS])
  out = [r.json for r in results]
  assert [o["same"] for o in out] == [True] * 4, [r.log() for r in results]
  total = out[0]["total"]
  assert 497_000_000 < total < 499_000_000
  for o in out:
    assert o["share"] == total // 4, o
    assert o["nbytes"] <= 1.1 * o["share"], o
